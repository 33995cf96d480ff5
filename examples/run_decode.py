"""Decoding across processes: a few query tokens against a key/value cache
split over the ranks, merged by a butterfly (tree attention); error against
a single-process float64 reference and the bytes each rank sent.

    torchrun --nproc-per-node 4 examples/run_decode.py [--queries 4 --cache 4001]

Runs on the CPU with gloo when there is no GPU (one GPU per rank with NCCL
otherwise).  examples/decode.ncd asks for 4 devices.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout

from napkin.distributed.demo import decode_main  # noqa: E402

if __name__ == "__main__":
    decode_main(str(Path(__file__).resolve().parent / "decode.ncd"))
