"""Train a small Llama-family checkpoint on the generated corpus, so its text reads like text.

The corpus has repeated structure (templated sentences, a fixed set of questions, chat turns in
the checkpoint's own template), so a model of a million parameters learns it in a minute on a
CPU: greedy continuations become corpus-like sentences, and the next tokens are predictable
enough for speculative decoding to mean something. Training uses a plain-torch forward with the
checkpoint's tensor names and Llama's exact arithmetic (RMSNorm, rotary embedding on halves, GQA,
SwiGLU), so the engine and transformers load the result like any other checkpoint.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SEQ_LEN = 128


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def forward(params: dict[str, torch.Tensor], ids: torch.Tensor, config: dict) -> torch.Tensor:
    """Logits [batch, seq, vocab] of a Llama checkpoint given as its tensors (differentiable)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, eps = config["head_dim"], config["rms_norm_eps"]
    b, t = ids.shape
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x = params["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, params[p + "input_layernorm.weight"], eps)
        q = (h @ params[p + "self_attn.q_proj.weight"].T).view(b, t, heads, head_dim).transpose(1, 2)
        k = (h @ params[p + "self_attn.k_proj.weight"].T).view(b, t, kv_heads, head_dim).transpose(1, 2)
        v = (h @ params[p + "self_attn.v_proj.weight"].T).view(b, t, kv_heads, head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.transpose(1, 2).reshape(b, t, heads * head_dim) @ params[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, params[p + "post_attention_layernorm.weight"], eps)
        gate = F.silu(h @ params[p + "mlp.gate_proj.weight"].T) * (h @ params[p + "mlp.up_proj.weight"].T)
        x = x + gate @ params[p + "mlp.down_proj.weight"].T
    return _rms_norm(x, params["model.norm.weight"], eps) @ params["lm_head.weight"].T


def training_text(
    corpus: list[str], render_chat: Callable[[list[dict]], str], seed: int, documents: int
) -> list[str]:
    """Documents of corpus sentences, half of them as chat turns (a question, then sentences as the
    answer) so that a chat completion answers in the corpus's words."""
    rng = random.Random(seed)
    questions = [line for line in corpus if line.endswith("?") and len(line) < 80]
    sentences = [line for line in corpus if not line.endswith("?") and len(line) < 120]
    docs = []
    for i in range(documents):
        body = " ".join(rng.choice(sentences) for _ in range(rng.randint(2, 5)))
        if i % 2:
            docs.append(
                render_chat(
                    [
                        {"role": "user", "content": rng.choice(questions)},
                        {"role": "assistant", "content": body},
                    ]
                )
            )
        else:
            docs.append(body)
    return docs


def batches(token_docs: list[list[int]], batch: int, seed: int):
    """Endless [batch, SEQ_LEN + 1] windows over the concatenated documents."""
    stream = [t for doc in token_docs for t in doc]
    data = torch.tensor(stream, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()])


def train(
    params: dict[str, torch.Tensor],
    config: dict,
    token_docs: list[list[int]],
    steps: int,
    seed: int = 0,
    batch: int = 8,
    lr: float = 3e-3,
    bf16: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[float]:
    """AdamW with warm-up and cosine decay for `steps` steps (a fixed count, not a time budget, so
    every machine trains the same recipe; the bits differ only by the order of parallel float
    additions); `params` are updated in place. Returns the loss of every step. `bf16`: the forward
    and backward matmuls run under bfloat16 autocast (about 1.8x float32 on a CPU with AVX-512
    BF16), the weights and the optimizer stay float32."""
    torch.manual_seed(seed)
    weights = [t.requires_grad_(True) for t in params.values()]
    decay = [t for name, t in params.items() if not name.endswith("norm.weight")]
    keep = [t for name, t in params.items() if name.endswith("norm.weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": keep, "weight_decay": 0.0}], lr=lr
    )
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    losses = []
    data = batches(token_docs, batch, seed)
    started = time.perf_counter()
    for step in range(steps):
        window = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward(params, window[:, :-1], config)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress and (step + 1) % max(1, steps // 10) == 0:
            recent = losses[-20:]
            progress(
                f"training step {step + 1}/{steps}: loss {sum(recent) / len(recent):.3f} "
                f"({time.perf_counter() - started:.0f} s)"
            )
    for t in weights:
        t.requires_grad_(False)
    return losses
