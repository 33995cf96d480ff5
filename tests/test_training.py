"""Training with a generated attention: a tiny transformer block, torch.compile,
autocast and activation checkpointing (kernels under TRITON_INTERPRET=1).

The block's attention is the causal example at head dim 16, called as the
generated module's ``causal(Q, K, V)``: its torch op runs the forward kernel
and registers the backward kernels with autograd.  The same block with
torch's scaled_dot_product_attention is the yardstick.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_backward import compile_text, gradients

REPO = Path(__file__).resolve().parent.parent
BLOCKS = {"block_q": 16, "block_x": 16}


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    text = (REPO / "examples" / "causal.ncd").read_text().replace("wire d = 64", "wire d = 16")
    return compile_text(text, "causal16", tmp_path_factory.mktemp("training"))


def generated_attention(m):
    return lambda q, k, v: m.causal(q, k, v, **BLOCKS)[0]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """Embedding, one pre-norm transformer block (2 heads of 16), a vocabulary head."""

    def __init__(self, attention, vocab=50, dim=32, heads=2):
        super().__init__()
        self.attention, self.heads = attention, heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attention(q, k, v)                      # (b, heads, n, 16); q, k, v are strided views
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, dim))
        return self.head(x + self.mlp(self.norm2(x)))


def train(attention, steps=6, seed=0):
    torch.manual_seed(seed)
    model = Block(attention)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randint(0, 50, (2, 41), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 50), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_block_follows_the_sdpa_loss_curve(causal):
    ours, theirs = train(generated_attention(causal)), train(sdpa)
    assert ours[-1] < ours[0] - 0.3                          # it learns
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4, (ours, theirs)


def test_torch_compile_sees_one_op_and_no_graph_break(causal):
    attention = generated_attention(causal)

    def step(q, k, v):
        return (attention(q, k, v) * torch.linspace(-1, 1, 16)).sum()

    q, k, v = causal.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32)
    explain = torch._dynamo.explain(step)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = gradients(compiled, (q, k, v))
    want = gradients(step, (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_autocast_runs_the_kernels_in_the_autocast_dtype(causal):
    torch.manual_seed(0)
    model = Block(generated_attention(causal))
    tokens = torch.randint(0, 50, (2, 33), generator=torch.Generator().manual_seed(2))
    seen = []
    model.attention = lambda q, k, v: seen.append(q.dtype) or generated_attention(causal)(q, k, v)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert seen == [torch.float16]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    full = Block(sdpa)
    full.load_state_dict(model.state_dict())
    reference = full(tokens).float().logsumexp(-1).mean()
    assert abs(loss.item() - reference.item()) < 2e-2


def test_activation_checkpointing_gives_the_same_gradients(causal):
    from torch.utils.checkpoint import checkpoint

    attention = generated_attention(causal)
    inputs = causal.example_inputs({"b": 1, "h": 2, "q": 37, "x": 37}, dtype=torch.float32)
    plain = gradients(attention, inputs)
    checkpointed = gradients(lambda q, k, v: checkpoint(attention, q, k, v, use_reentrant=False), inputs)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
