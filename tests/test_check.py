"""scripts/check.py: what a notebook's record says about memory is the peak of its whole process tree (the
kernel and what it started), not of the process the check launched."""

import subprocess
import sys
import time

import psutil

from conftest import load_script

# Holds `mb` MB of touched memory, starts the next script if one is given, says it is ready once its memory (and
# its child's) is held, then waits on stdin.
HOLD = """
import pathlib, subprocess, sys, time
mb, ready, nxt = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
block = bytearray(mb * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
child = subprocess.Popen([sys.executable, *nxt], stdin=subprocess.PIPE) if nxt else None
while child and not pathlib.Path(nxt[2]).exists():
    assert child.poll() is None, "the child died"
    time.sleep(0.02)
ready.touch()
sys.stdin.read()
if child:
    child.stdin.close()
    child.wait()
"""


class _Ticks:
    """`done` for the sampler: not done for `n` samples, then done; no clock involved."""

    def __init__(self, n):
        self.n = n

    def wait(self, _timeout):
        self.n -= 1
        return self.n < 0


def test_peak_memory_sums_the_whole_process_tree(tmp_path):
    check = load_script("scripts/check.py")
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    ready = tmp_path / "parent.ready"
    proc = subprocess.Popen([sys.executable, str(script), "300", str(ready),
                             str(script), "200", str(tmp_path / "child.ready")], stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not ready.exists():  # the parent says so once both hold their memory
            assert proc.poll() is None and time.time() < deadline, "the processes did not get ready"
            time.sleep(0.05)
        peaks = {}
        check._sample_peaks(proc.pid, _Ticks(3), peaks, interval_s=0)
        own = psutil.Process(proc.pid).memory_info().rss / 2**30
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert own > 0.28  # the parent alone: its 300 MB
    assert peaks["peak_rss_gib"] >= own + 0.18  # and its child's 200 MB on top
