"""Ring Attention across processes, napkin's baseline for ATTENTION2D: error
against a single-process reference and the bytes each rank sent.

    torchrun --nproc-per-node 4 examples/run_ring_attention.py [--tokens 1001]

Runs on the CPU with gloo when there is no GPU (one GPU per rank with NCCL
otherwise).  examples/ring_attention.ncd asks for a ring of 4.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

from napkin.distributed.demo import main  # noqa: E402

if __name__ == "__main__":
    main("ring", str(Path(__file__).resolve().parent / "ring_attention.ncd"))
