"""`.ci/provision` against a stub apt-get: it asks for each missing tool on its own, checks apt's plan first, never
asks for a tool already on the PATH, and names what apt cannot install (the fresh-machine failure: Node.js + npm
preinstalled from a packaging that conflicts with Debian's npm, and apt refusing the whole set)."""

import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "provision"

# The stub: logs every call; `install -s PKG` fails like apt when PKG is in STUB_BROKEN; `install PKG` puts the
# tool STUB_PROVIDES maps PKG to on the PATH.
STUB = r"""#!/bin/bash
echo "$*" >> "$STUB_LOG"
[ "$1" = update ] && exit 0
pkg="${@: -1}"
if [ "$2" = -s ]; then
  for b in $STUB_BROKEN; do
    if [ "$b" = "$pkg" ]; then
      echo "Reading package lists..."
      echo " $pkg : Depends: nodejs but it is not going to be installed"
      echo "E: Unable to correct problems, you have held broken packages."
      exit 100
    fi
  done
  exit 0
fi
for m in $STUB_PROVIDES; do
  if [ "${m%%=*}" = "$pkg" ]; then printf '#!/bin/sh\n' > "$STUB_BIN/${m#*=}"; chmod +x "$STUB_BIN/${m#*=}"; fi
done
"""


def _provision(tmp_path, present, broken=(), args=()):
  """Runs the script with a PATH of only the stub bin (the `present` tools faked there) and basic utilities."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for util in ("bash", "sed", "grep", "tail", "chmod"):
    os.symlink(shutil.which(util), bin_dir / util)
  for tool in present:
    (bin_dir / tool).write_text("#!/bin/sh\n")
    (bin_dir / tool).chmod(0o755)
  apt = tmp_path / "apt-get"
  apt.write_text(STUB)
  apt.chmod(0o755)
  log = tmp_path / "apt.log"
  log.touch()
  env = {"PATH": str(bin_dir), "APT_GET": str(apt), "STUB_LOG": str(log), "STUB_BIN": str(bin_dir),
         "STUB_BROKEN": " ".join(broken),
         "STUB_PROVIDES": "bubblewrap=bwrap docker.io=dockerd debootstrap=debootstrap npm=npm"}
  done = subprocess.run([shutil.which("bash"), str(SCRIPT), *args], env=env, capture_output=True, text=True,
                        timeout=60, check=False)
  return done, log.read_text().splitlines()


def test_asks_only_for_missing_tools_one_at_a_time(tmp_path):
  done, calls = _provision(tmp_path, present=["npm", "node"])
  assert done.returncode == 0, done.stdout + done.stderr
  assert calls == ["update -qq",
                   "install -s -y bubblewrap", "install -y -qq bubblewrap",
                   "install -s -y docker.io", "install -y -qq docker.io",
                   "install -s -y debootstrap", "install -y -qq debootstrap"]
  assert "npm found" in done.stdout and "dockerd installed from docker.io" in done.stdout


def test_nothing_missing_never_calls_apt(tmp_path):
  done, calls = _provision(tmp_path, present=["bwrap", "dockerd", "debootstrap", "npm"])
  assert done.returncode == 0, done.stdout
  assert calls == []


def test_a_package_apt_refuses_is_named_and_fails_after_installing_the_rest(tmp_path):
  done, calls = _provision(tmp_path, present=["node"], broken=["npm"])
  assert done.returncode == 1
  assert "npm is missing and apt cannot install npm" in done.stdout
  assert "held broken packages" in done.stdout  # apt's own reason is shown
  assert done.stdout.strip().endswith("still missing: npm")
  assert "install -y -qq npm" not in calls  # refused by the plan check, never attempted
  assert "install -y -qq bubblewrap" in calls and "install -y -qq debootstrap" in calls


def test_explicit_tool_list(tmp_path):
  done, calls = _provision(tmp_path, present=[], args=["debootstrap=debootstrap"])
  assert done.returncode == 0, done.stdout
  assert calls == ["update -qq", "install -s -y debootstrap", "install -y -qq debootstrap"]
