#!/bin/sh
# Prints a seccomp profile for haltd's container: podman's default profile
# (containers-common, /usr/share/containers/seccomp.json, or the file given) with the system
# calls haltd needs added. The default refuses bpf(2) without CAP_SYS_ADMIN (haltd needs
# CAP_BPF, not CAP_SYS_ADMIN) and knows no io_uring call (haltd's data plane runs on
# io_uring), so with it haltd cannot load its gate, nor serve.
#
#   deploy/container/seccomp-profile.sh > /etc/haltd/seccomp.json
#   podman run --security-opt seccomp=/etc/haltd/seccomp.json ...
set -eu
exec python3 - "${1:-/usr/share/containers/seccomp.json}" <<'PY'
import json, sys

NEEDED = ["bpf", "io_uring_setup", "io_uring_enter", "io_uring_register"]
profile = json.load(open(sys.argv[1]))
rules = []
for rule in profile["syscalls"]:
    names = [n for n in rule["names"] if n not in NEEDED]
    if names:
        rule["names"] = names
        rules.append(rule)
rules.append({"names": NEEDED, "action": "SCMP_ACT_ALLOW", "args": [], "comment": "haltd",
              "includes": {}, "excludes": {}})
profile["syscalls"] = rules
json.dump(profile, sys.stdout, indent=1)
print()
PY
