"""Loss memory: the chunked tail loss (``loss.chunk_size``) vs today's unchunked one, forward + backward.

    python benchmarks/loss_memory.py [--tails 512 2048 8192] [--chunk auto]

SmolLM2-135M's LM head (hidden 576, vocab 49,152, fp32, frozen as under LoRA). For each number ``N`` of tail
positions (one micro-batch of 4 rows of ``N / 4`` trained tokens: an SFT answer is the whole tail) it records the
peak bytes of live tensors created by the loss, from the hidden states ``[B, N/B, H]`` to their gradient: today's
``lm_head -> [B, N/B, V] -> scale.loss.tail.tail_loss -> backward`` against ``scale.loss.chunked.chunked_tail_loss``.
Bytes are counted on fake tensors (``FakeTensorMode``: shapes, no memory; the same count as real tensors, checked at the
smallest ``N``), so ``N = 8192`` (1.5 GiB per fp32 logits tensor) runs on a small machine. The smallest ``N`` also
runs on real tensors (chunks of 128) to check the two losses and gradients agree.
Prints a table and ``loss_memory: ratio=X``, the smallest ratio at ``N >= 2048`` (target >= 4).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/loss_memory.py`: make `tests` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale.loss import chunked  # noqa: E402
from scale.loss import tail as scale_loss  # noqa: E402
from tests.live_bytes import LiveBytes  # noqa: E402

H, V, ROWS = 576, 49152, 4


class Head(torch.nn.Module):
    """Just an LM head, as ``chunked.output_head`` finds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.lm_head.weight.requires_grad_(False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def one(head: Head, n: int, chunk: int | str, fake: bool, dtype: torch.dtype = torch.float32
        ) -> tuple[int, float, torch.Tensor]:
    """(peak bytes, loss, hidden grad) of one forward + backward of the loss over ``n`` tail positions
    (``dtype``: of the hidden states; the head must have it too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(ROWS, n // ROWS, H, generator=g).to(dtype)
    targets = torch.randint(0, V, (ROWS, n // ROWS), generator=g)
    weights = torch.ones(ROWS, n // ROWS)
    weights[0, : n // (2 * ROWS)] = 0  # one row's tail is half as long: masked positions, as in a real batch
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    if mode is not None:
        hidden, targets, weights = (mode.from_tensor(x) for x in (hidden, targets, weights))
    hidden.requires_grad_(True)
    size = chunked.resolve_chunk_size(chunk, n, V)
    live = LiveBytes()
    with (mode or torch.autocast("cpu", enabled=False)), live:
        if size:
            # Fake tensors have no nonzero(): the count keeps the masked positions too (an upper bound; the
            # real run drops them before the head).
            num, den = chunked.chunked_tail_loss(head, hidden, targets, weights, size, drop_zero_weights=not fake)
        else:
            num, den = scale_loss.tail_loss(head.lm_head(hidden), targets, weights)
        (num / den).backward()
    return live.peak, (0.0 if fake else float((num / den).detach())), hidden.grad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tails", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--chunk", default="auto", help="loss.chunk_size of the chunked contestant")
    args = parser.parse_args()
    chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
    torch.manual_seed(0)
    head = Head()
    n0 = min(args.tails)
    real = [one(head, n0, c, fake=False) for c in (0, 128)]  # exactness at the smallest N, chunks of 128
    fake0 = one(head, n0, 128, fake=True)[0]
    gdiff = float((real[0][2] - real[1][2]).abs().max() / real[0][2].abs().max())
    head64 = copy.deepcopy(head).double()  # the same check in float64: what is left of the difference is round-off
    real64 = [one(head64, n0, c, fake=False, dtype=torch.float64) for c in (0, 128)]
    gdiff64 = float((real64[0][2] - real64[1][2]).abs().max() / real64[0][2].abs().max())
    sys.stdout.write(f"float64: loss rel diff {abs(real64[0][1] - real64[1][1]) / real64[0][1]:.1e}, hidden grad "
                     f"max rel diff {gdiff64:.1e}\n")
    sys.stdout.write(f"check at N={n0}, chunks of 128: loss {real[0][1]:.7f} unchunked vs {real[1][1]:.7f} chunked (rel "
                     f"{abs(real[0][1] - real[1][1]) / real[0][1]:.1e}); hidden grad max rel diff {gdiff:.1e}; "
                     f"chunked peak real {real[1][0] / 2**20:.1f} MiB vs fake count {fake0 / 2**20:.1f} MiB\n")
    rows = ["| N tail positions | chunk | today's unchunked (MiB) | chunked (MiB) | ratio |", "|---|---|---|---|---|"]
    worst = float("inf")
    for n in args.tails:
        today = one(head, n, 0, fake=True)[0]
        ours = one(head, n, chunk, fake=True)[0]
        size = chunked.resolve_chunk_size(chunk, n, V)
        ratio = today / ours
        if n >= 2048:
            worst = min(worst, ratio)
        rows.append(f"| {n} | {size or 'none'} | {today / 2**20:.1f} | {ours / 2**20:.1f} | {ratio:.1f}x |")
    sys.stdout.write(f"\nLM head {H} -> {V} (SmolLM2-135M), fp32, {ROWS} rows; peak live bytes of loss forward + "
                     f"backward\n" + "\n".join(rows) + "\n")
    sys.stdout.write(f"loss_memory: ratio={worst:.2f} (smallest at N >= 2048; target >= 4)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
