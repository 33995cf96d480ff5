"""ATTENTION2D across processes: error against a single-process reference and
the bytes each rank sent.

    torchrun --nproc-per-node 4 examples/run_attention_2d.py [--tokens 1001]

Runs on the CPU with gloo when there is no GPU (one GPU per rank with NCCL
otherwise).  The diagram's devices level (examples/attention_2d.ncd: a 2 x 2
grid) sets how many processes it needs; see --help for the options.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

from napkin.distributed.demo import main  # noqa: E402

if __name__ == "__main__":
    main("attention2d", str(Path(__file__).resolve().parent / "attention_2d.ncd"))
