"""Where engines come from: one small interface (base.py), a local one and a command-line one."""
