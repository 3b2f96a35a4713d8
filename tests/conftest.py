"""Settings every test shares."""

from hypothesis import settings

# Property tests check behaviour, not speed: a per-example deadline fails them on a busy 2-core machine
# (a 367 ms example of a 200 ms deadline, with other processes running) without anything being wrong.
settings.register_profile("kvmesh", deadline=None)
settings.load_profile("kvmesh")
