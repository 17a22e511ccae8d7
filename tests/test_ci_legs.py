""".ci/legs.sh's legs: `leg` in the foreground, `beside` in one lane next to it, `await`.

Each test runs a small script that sources legs.sh as .ci/run does and reads the table it
prints on exit: the legs' times and CPU seconds, what failed, what a failure stopped.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

LEGS = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "legs.sh"

pytestmark = [
    pytest.mark.skipif(not LEGS.is_file(), reason=".ci/ is part of the checkout"),
    pytest.mark.skipif(shutil.which("bash") is None or not pathlib.Path("/proc/self/stat").exists(),
                       reason="the legs run under bash on Linux"),
]

# busy N: N seconds of CPU time (not of the clock: a loaded machine does not change it)
BUSY = ('busy() { python3 -c "import time; exec(\'while time.process_time() < $1: pass\')"; }\n'
        # meet A B: touches A, then waits (at most 20 s) for B: two legs that meet ran together
        'meet() { touch "$1"; for _ in $(seq 200); do [ -e "$2" ] && return 0; sleep 0.1; done;'
        ' return 1; }')


def run_legs(tmp_path, body: str, timeout: float = 60):
    script = tmp_path / "run"
    script.write_text(f"set -euo pipefail\ncd {tmp_path}\nsource {LEGS}\n{BUSY}\n{body}\n")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout)
    rows = {}
    table = done.stdout.split("\nleg ", 1)[1].splitlines()[1:]
    for line in table:
        name, seconds, cpu, result = re.match(r"(\S+)\s+(\S+)\s+(\S+)\s+(.*)", line).groups()
        rows[name] = (seconds, cpu, result)
    return done, rows


def test_a_lane_runs_beside_the_foreground(tmp_path):
    done, rows = run_legs(tmp_path, """
beside lane1 meet lane-here front-here
beside lane2 bash -c 'echo from-lane2'
leg front meet front-here lane-here
await lane1 lane2
""")
    assert done.returncode == 0, done.stdout + done.stderr
    assert rows["front"][2] == "ok" and rows["lane1"][2] == rows["lane2"][2] == "ok (beside)"
    # A lane leg's output comes whole, under its own heading, when it is awaited.
    lines = done.stdout.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("=== lane2 (ran beside"))
    assert lines.index("from-lane2") == heading + 1


def test_each_leg_counts_the_cpu_of_its_own_processes(tmp_path):
    done, rows = run_legs(tmp_path, """
beside lane busy 2
leg front busy 1
await lane
""")
    assert done.returncode == 0, done.stdout + done.stderr
    assert rows["front"][1] == "1" and rows["lane"][1] in ("2", "3"), rows
    assert int(rows["total"][1]) == int(rows["front"][1]) + int(rows["lane"][1])


def test_a_failing_lane_leg_fails_the_run_and_the_rest_of_its_lane_does_not_run(tmp_path):
    done, rows = run_legs(tmp_path, """
beside first bash -c 'echo broke; exit 3'
beside second bash -c 'echo must-not-run'
leg front true
await first second
leg after true
""")
    assert done.returncode != 0
    assert rows["first"][2] == "FAILED (3, beside)" and rows["second"][2] == "not run (beside)"
    assert "after" not in rows and "must-not-run" not in done.stdout.splitlines()
    assert "broke" in done.stdout and rows["total"][2] == "FAILED"


def test_a_failure_in_the_foreground_stops_the_lane_and_shows_its_output(tmp_path):
    done, rows = run_legs(tmp_path, """
beside slow bash -c 'echo started; sleep 300 & echo $! >sleeper.pid; wait'
leg front bash -c 'until [ -s sleeper.pid ]; do sleep 0.1; done; exit 4'
""", timeout=30)  # the lane's sleep would outlast it: the run must stop it
    assert done.returncode == 4
    assert rows["front"][2] == "FAILED (4)" and rows["slow"][2] == "stopped (beside)"
    assert "started" in done.stdout
    sleeper = int((tmp_path / "sleeper.pid").read_text())
    assert not _alive(sleeper), "the lane's processes outlived the run"


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie that init has yet to reap does not)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_lane_killed_from_outside_fails_the_run_instead_of_hanging(tmp_path):
    done, rows = run_legs(tmp_path, """
beside victim sleep 300
sleep 1
kill -KILL -- "-${_LANE_PID[victim]}"
await victim
""", timeout=30)
    assert done.returncode != 0
    assert rows["victim"][2] == "FAILED (died, beside)", rows
