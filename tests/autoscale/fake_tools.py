"""Fake `docker` and `kubectl` executables for the example providers: state in a JSON file ($FAKE_STATE)."""

FAKE_DOCKER = r'''#!/usr/bin/env python3
import json, os, sys
path = os.environ["FAKE_STATE"]
state = json.load(open(path)) if os.path.exists(path) else {"containers": [], "next": 0, "calls": []}
args = sys.argv[1:]
state["calls"].append(args)
out = ""
if args[:1] == ["compose"]:
    rest = args[3:]
    if rest[:2] == ["ps", "-q"]:
        out = "".join(c["id"] + "0000\n" for c in state["containers"])
    elif rest[:1] == ["up"]:
        want = int(rest[rest.index("--scale") + 1].split("=")[1])
        while len(state["containers"]) < want:
            state["next"] += 1
            state["containers"].append({"id": f"c{state['next']:011d}", "port": 32000 + state["next"]})
elif args[:1] == ["port"]:
    c = next(c for c in state["containers"] if c["id"] == args[1])
    out = f"0.0.0.0:{c['port']}\n"
elif args[:2] == ["rm", "-f"]:
    state["containers"] = [c for c in state["containers"] if c["id"] != args[2]]
else:
    sys.exit(f"fake docker: unexpected {args}")
json.dump(state, open(path, "w"))
print(out, end="")
'''

FAKE_KUBECTL = r'''#!/usr/bin/env python3
import json, os, sys
path = os.environ["FAKE_STATE"]
state = json.load(open(path)) if os.path.exists(path) else {"pods": {}, "calls": []}
args = sys.argv[1:]
assert args[:2] == ["-n", "default"], args
args = args[2:]
state["calls"].append(args)
out = ""
if args[:3] == ["apply", "-f", "-"]:
    pod = json.load(sys.stdin)
    pod["status"] = {"podIP": f"10.1.0.{len(state['pods']) + 1}"}
    state["pods"][pod["metadata"]["name"]] = pod
elif args[:1] == ["wait"]:
    assert args[2].removeprefix("pod/") in state["pods"]
elif args[:2] == ["get", "pod"]:
    out = json.dumps(state["pods"][args[2]])
elif args[:2] == ["get", "pods"]:
    out = json.dumps({"items": list(state["pods"].values())})
elif args[:2] == ["delete", "pod"]:
    del state["pods"][args[2]]
else:
    sys.exit(f"fake kubectl: unexpected {args}")
json.dump(state, open(path, "w"))
print(out, end="")
'''
