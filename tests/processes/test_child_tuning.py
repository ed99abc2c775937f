"""How a helper process tunes its interpreter for the bodies it copies."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What the capture process does with each 32k-token exchange: a frame read into a buffer of its
# own, its request and response copied out, the prompt's text kept while its trajectory is open;
# prints the page faults taken.
COPIES = """
import resource, sys
from trace_proxy.processes.helper import tune_malloc
if sys.argv[1] == "tuned":
    tune_malloc()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
kept = []
for i in range(200):
    frame = bytearray(800_000 + i)
    request, response = bytes(frame[:400_000]), bytes(frame[400_000:])
    del frame
    kept.append(request[1:-1])
    if len(kept) > 4:
        del kept[0]
    del request, response
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_helper_copies_long_bodies_without_faulting_in_fresh_pages() -> None:
    def faults(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", COPIES, mode], capture_output=True, text=True, check=True
        )
        return int(done.stdout)

    untuned, tuned = faults("default"), faults("tuned")
    # By default glibc maps most of these copies on their own, or gives the heap's top back to
    # the kernel and faults it in again: about 65 faults per exchange. Tuned, the heap keeps
    # what it freed: the faults of its first growth, about 6 per exchange over 200.
    assert tuned < 200 * 10, tuned
    assert untuned > 4 * tuned, (untuned, tuned)
