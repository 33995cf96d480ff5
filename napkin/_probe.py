"""The kernel napkin.interpreter runs to tell whether Triton's interpreter
works here: a loop bound read from an argument, as every napkin kernel has.
A module of its own so that importing napkin never imports Triton."""
import triton
import triton.language as tl


@triton.jit
def loop_to_argument(X, n):
    acc = 0.0
    for i in range(0, n):
        acc += tl.load(X + i)
    tl.store(X, acc)
