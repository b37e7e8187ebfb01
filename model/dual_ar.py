"""The Fish Speech 1.5 DualAR transformer: a slow LLaMA over frames and a fast LLaMA over the codebooks of a frame.

Owns the architecture and four forward paths: teacher-forced `forward` (training / parity), `prefill` (one slot,
any start position, so a session can append to its cache), batched one-step `decode_slow` over cache rows
[0, B), and `fast_step` (one codebook position for B rows). Parameter names equal the official checkpoint's.
Sampling and the per-frame loop live in `model.frame`; slot scheduling lives in `streaming/`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import decode_attention, gemv
from .compiled_regions import region
from .config import DualARConfig
from .kv_cache import SEQ_ALIGN, KVCache
from .layers import Attention, Embedding, FeedForward, Linear, RMSNorm, TransformerBlock, invariant_linear
from .rope import build_rope_table


def right_pad(
    prompts: Sequence[torch.Tensor], start_positions: Sequence[int], tokens: torch.Tensor, positions: torch.Tensor
) -> None:
    """Lay prompts[b] (1+nc, T_b) into tokens[b] (1+nc, T, zeros beyond the prompt: the caller zeroes them) and their
    positions into positions[b] (T,). Padding tokens sit at the row's first position after its prompt, which the row's
    next write overwrites before anything reads it (the padding convention of every batched prefill pass)."""
    for b, (prompt, start) in enumerate(zip(prompts, start_positions, strict=True)):
        n = prompt.shape[-1]
        tokens[b, :, :n] = prompt
        positions[b, :n] = torch.arange(start, start + n)
        positions[b, n:] = start + n


class DualARTransformer(nn.Module):
    def __init__(self, config: DualARConfig, semantic_begin_id: int) -> None:
        super().__init__()
        c = config
        self.config = c
        self.semantic_begin_id = semantic_begin_id
        # The tokenizer always has 1024 semantic ids, whatever codebook_size is (spec §3).
        self.semantic_end_id = semantic_begin_id + 1023
        self.embeddings = Embedding(c.vocab_size, c.dim)
        self.codebook_embeddings = Embedding(c.codebook_size * c.num_codebooks, c.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(c.dim, c.n_head, c.n_local_heads, c.intermediate_size, c.attention_qkv_bias, c.norm_eps)
            for _ in range(c.n_layer)
        )
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_word_embeddings else Linear(c.dim, c.vocab_size, bias=False)
        # identity (no keys) when the fast stack is as wide as the slow one, as in the official model
        self.fast_project_in = Linear(c.dim, c.fast_dim) if c.has_fast_project_in else nn.Identity()
        self.fast_embeddings = Embedding(c.codebook_size, c.fast_dim)
        self.fast_layers = nn.ModuleList(
            TransformerBlock(
                c.fast_dim, c.fast_n_head, c.fast_n_local_heads, c.fast_intermediate_size,
                bool(c.fast_attention_qkv_bias), c.norm_eps,
            )
            for _ in range(c.n_fast_layer)
        )  # fmt: skip
        self.fast_norm = RMSNorm(c.fast_dim, c.norm_eps)
        self.fast_output = Linear(c.fast_dim, c.codebook_size, bias=False)
        self.register_buffer("freqs_cis", build_rope_table(c.max_seq_len, c.head_dim, c.rope_base), persistent=False)
        self.register_buffer(
            "fast_freqs_cis", build_rope_table(c.num_codebooks, c.fast_head_dim, c.rope_base), persistent=False
        )
        # the fast step attends over its whole (tiny) cache, masked to the positions written so far (as upstream):
        # one shape for every codebook position
        fast_len = -(-c.num_codebooks // SEQ_ALIGN) * SEQ_ALIGN
        cpu = torch.device("cpu")  # real data even under a meta-device context, like the RoPE tables
        # one row per codebook position, each row starting on a 16-byte boundary: a compiled block copies every
        # input that is not so aligned before it runs (two copies per fast layer call, ~85 µs of a one-row step on
        # the H200); fast_positions[pos, 0] is pos
        causal = torch.ones(fast_len, fast_len, dtype=torch.bool, device=cpu).tril()
        self.register_buffer("fast_causal", torch.nn.functional.pad(causal, (0, -fast_len % 16)), False)
        positions = torch.arange(fast_len, device=cpu).unsqueeze(1)
        self.register_buffer("fast_positions", torch.nn.functional.pad(positions, (0, 1)), persistent=False)
        self.freqs_cis: torch.Tensor
        self.fast_freqs_cis: torch.Tensor
        self.fast_causal: torch.Tensor
        self.fast_positions: torch.Tensor
        self.batch_invariant = False

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every matmul row-independent (see layers.Linear): a row's output no longer depends on batch size."""
        self.batch_invariant = enabled
        for module in self.modules():
            if isinstance(module, Linear | Attention):
                module.batch_invariant = enabled

    def use_length_attention(self, enabled: bool) -> None:
        """Both stacks' cached decode attention through model.decode_attention's kernel, which stops at each row's
        position instead of reading the whole attention bucket (not batch-invariant mode: that keeps its own
        row-independent attention). The fast stack's mask is "positions ≤ the codebook position" too, so its
        attention is one kernel instead of inductor's four (6.3-9.5 → 5.7 µs a layer with the cache writes at one row:
        H200). Raises where the kernel cannot run (no Triton, no CUDA)."""
        if enabled and not decode_attention.supported(self.embeddings.weight.device):
            raise ValueError("the length-aware decode attention needs a CUDA GPU and Triton")
        for module in self.modules():
            if isinstance(module, Attention):
                module.length_attention = enabled

    def one_row_products(self) -> set[gemv.Product]:
        """The products a one-row decode step runs through model.gemv's kernels (TransformerBlock._few_rows, the
        heads up to gemv.MAX_HEAD_ROWS outputs): what gemv.self_check checks. Needs fuse_feed_forward."""
        out: set[gemv.Product] = set()

        def add(weight: torch.Tensor, fused: str, residual: bool = False, rope_rows: int = 0, head_dim: int = 0):
            out.add(gemv.Product(int(weight.shape[0]), int(weight.shape[1]), fused, residual, rope_rows, head_dim))

        for module in self.modules():
            if isinstance(module, TransformerBlock) and module.feed_forward.w13 is not None:
                a = module.attention
                add(a.wqkv.weight, "norm", rope_rows=a.qk_width, head_dim=a.head_dim)
                add(a.wo.weight, "plain", residual=True)
                add(module.feed_forward.w13, "norm")
                add(module.feed_forward.w2.weight, "swiglu", residual=True)
        for head in (self.fast_output.weight, self.token_head_weight):
            if head.shape[0] <= gemv.MAX_HEAD_ROWS:
                add(head, "norm")
        return out

    def fuse_feed_forward(self) -> None:
        """One matmul for each layer's w1 and w3 (see layers.FeedForward.fuse); for inference after loading."""
        for module in self.modules():
            if isinstance(module, FeedForward):
                module.fuse()

    # ---- caches ------------------------------------------------------------------------------------------------------
    def make_cache(self, n_slots: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        weight = self.embeddings.weight
        return KVCache(
            c.n_layer, n_slots, c.n_local_heads, max_seq_len or c.max_seq_len, c.head_dim,
            dtype or weight.dtype, weight.device,
        )  # fmt: skip

    def make_fast_cache(self, n_slots: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        weight = self.embeddings.weight
        return KVCache(
            c.n_fast_layer, n_slots, c.fast_n_local_heads, c.num_codebooks, c.fast_head_dim,
            dtype or weight.dtype, weight.device,
        )  # fmt: skip

    # ---- pieces ------------------------------------------------------------------------------------------------------
    def embed(self, inp: torch.Tensor, offset_codebooks: bool = True) -> torch.Tensor:
        """inp (B, 1+nc, T) → (B, T, dim): token embedding plus, at semantic tokens, the sum of codebook rows."""
        c = self.config
        codes = inp[:, 1:]  # (B, nc, T)
        if offset_codebooks:
            offsets = torch.arange(c.num_codebooks, device=inp.device).view(1, -1, 1) * c.codebook_size
            codes = codes + offsets
        vq_sum = self.codebook_embeddings(codes).sum(dim=1)  # (B, T, dim), summed in codebook order
        tokens = inp[:, 0]
        vq_sum = vq_sum * self.is_semantic(tokens).unsqueeze(-1).to(vq_sum.dtype)
        return self.embeddings(tokens) + vq_sum

    def is_semantic(self, tokens: torch.Tensor) -> torch.Tensor:
        """True where a token id is a semantic (audio frame) token, elementwise."""
        return (tokens >= self.semantic_begin_id) & (tokens <= self.semantic_end_id)

    @property
    def token_head_weight(self) -> torch.Tensor:
        """The text head's weight: its own output layer's, or the tied embeddings'."""
        return self.embeddings.weight if self.output is None else self.output.weight

    @region
    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head_by_gemv(hidden, self.token_head_weight, self.output):
            return gemv.linear(hidden, self.token_head_weight, self.norm.weight, self.norm.eps)
        normed = self.norm(hidden)
        if self.output is not None:
            return self.output(normed)
        if self.batch_invariant:
            return invariant_linear(normed, self.embeddings.weight)
        return F.linear(normed, self.embeddings.weight)

    @region
    def fast_logits(self, fast_hidden: torch.Tensor) -> torch.Tensor:
        if self._head_by_gemv(fast_hidden, self.fast_output.weight, self.fast_output):
            return gemv.linear(fast_hidden, self.fast_output.weight, self.fast_norm.weight, self.fast_norm.eps)
        return self.fast_output(self.fast_norm(fast_hidden))

    def _head_by_gemv(self, hidden: torch.Tensor, weight: torch.Tensor, linear: nn.Linear | None) -> bool:
        """A head's norm and product as one model.gemv kernel: one row, kernels on, no bias, not batch-invariant
        mode, at most gemv.MAX_HEAD_ROWS outputs (the text vocabulary's 102,048 stay with inductor)."""
        return (
            (linear is None or linear.bias is None)
            and not self.batch_invariant
            and weight.shape[0] <= gemv.MAX_HEAD_ROWS
            and gemv.applies(hidden, weight)
        )

    # ---- teacher-forced forward (training path; what the parity fixture's forward/* records) -------------------------
    def forward(self, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """inp (B, 1+nc, T) → token_logits (B, T, vocab), codebook_logits (B, T, nc, cs), slow hidden (B, T, dim).

        Position t's fast sequence is [project(hidden_t), E_fast[codes 0..nc-2 of frame t+1]]; positions whose
        shifted codes are all zero are skipped and their codebook logits are exact zeros (upstream behaviour).
        """
        c = self.config
        bsz, _, seqlen = inp.shape
        x = self.embed(inp)
        freqs = self.freqs_cis[:seqlen]
        for layer in self.layers:
            x = layer(x, freqs)
        slow_hidden = x
        token_logits = self.token_logits(x)

        shifted = F.pad(inp[:, 1:-1, 1:], (0, 1), value=0)  # (B, nc-1, T): codes 0..nc-2 of the next frame
        fast_in = torch.cat(
            [self.fast_project_in(x).unsqueeze(1), self.fast_embeddings(shifted)], dim=1
        )  # (B, nc, T, fast_dim)
        fast_in = fast_in.permute(0, 2, 1, 3).reshape(bsz * seqlen, c.num_codebooks, c.fast_dim)
        skip = (shifted.permute(0, 2, 1).reshape(bsz * seqlen, -1) == 0).all(dim=-1)
        if bool(skip.all()):
            skip[:8] = False  # upstream keeps the first 8 rows so the fast stack still runs
        h = fast_in[~skip]
        for layer in self.fast_layers:
            h = layer(h, self.fast_freqs_cis)
        logits = torch.zeros(bsz * seqlen, c.num_codebooks, c.codebook_size, dtype=h.dtype, device=h.device)
        logits[~skip] = self.fast_logits(h)
        return token_logits, logits.view(bsz, seqlen, c.num_codebooks, c.codebook_size), slow_hidden

    # ---- cached inference --------------------------------------------------------------------------------------------
    def _slow_cached(
        self, inp: torch.Tensor, cache: KVCache, row0: int, input_pos: torch.Tensor, attn_len: int
    ) -> torch.Tensor:
        """Run the slow stack over inp (B, 1+nc, T) at positions input_pos (B, T), rows [row0, row0+B)."""
        bsz = inp.shape[0]
        view = cache.view(row0, bsz, attn_len)
        x, freqs, mask = self._cached_inputs(inp, input_pos, attn_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, freqs, view.k[i], view.v[i], input_pos, mask)
        return x

    @region
    def _cached_inputs(
        self, inp: torch.Tensor, input_pos: torch.Tensor, attn_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The slow stack's inputs: embeddings (B, T, dim), RoPE rows (B, T, hd/2, 2), visibility (B, 1, T, L). A
        region: compiled, a decode step's ~15 small embedding and mask kernels (~30 µs at one row) become three (5.5 µs,
        H200)."""
        x = self.embed(inp, offset_codebooks=self.config.share_codebook_embeddings)
        freqs = self.freqs_cis[input_pos]
        visible = torch.arange(attn_len, device=inp.device).view(1, 1, -1) <= input_pos.unsqueeze(-1)
        return x, freqs, visible.unsqueeze(1)

    def prefill(
        self, tokens: torch.Tensor, cache: KVCache, slot: int, start_pos: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write tokens (1+nc, T) into `slot` at positions [start_pos, start_pos+T).

        Returns the last position's slow logits (vocab,) and fast input hidden (fast_dim,). Starting at a nonzero
        position appends to what the slot already holds (session continuation, chunked prefill).
        """
        seqlen = tokens.shape[-1]
        end = start_pos + seqlen
        if end > min(cache.max_seq_len, self.config.max_seq_len):
            raise ValueError(f"prefill to position {end} exceeds the context of {self.config.max_seq_len}")
        input_pos = torch.arange(start_pos, end, device=tokens.device).unsqueeze(0)
        x = self._slow_cached(tokens.unsqueeze(0), cache, slot, input_pos, end)
        last = x[:, -1]
        return self.token_logits(last)[0], self.fast_project_in(last)[0]

    def prefill_many(
        self, prompts: list[torch.Tensor], cache: KVCache, rows: list[int], start_positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` of several rows in one pass: prompts[b] (1+nc, T_b) into cache row rows[b] from start_positions[b].

        The rows' KV prefixes are gathered into a scratch cache, the prompts run right-padded as one batch, and the
        rows are written back. Padding tokens write to their row's first position after its prompt, which the row's
        first decode step overwrites before anything reads it. Returns each prompt's last-position slow logits
        (B, vocab) and fast input hidden (B, fast_dim). Not batch-invariant (the attention length is the batch's).
        """
        lengths = [p.shape[-1] for p in prompts]
        ends = [start + n for start, n in zip(start_positions, lengths, strict=True)]
        limit = min(cache.max_seq_len, self.config.max_seq_len)
        if max(ends) >= limit:  # the padding writes at `end`, which must exist
            raise ValueError(f"prefill to position {max(ends)} exceeds the context of {limit - 1}")
        device = prompts[0].device
        longest = max(lengths)
        tokens = torch.zeros(len(prompts), prompts[0].shape[0], longest, dtype=prompts[0].dtype, device=device)
        positions = torch.empty(len(prompts), longest, dtype=torch.long)
        right_pad(prompts, start_positions, tokens, positions)
        index = torch.tensor(rows, device=cache.k.device)
        last = torch.tensor(lengths, device=device) - 1
        return self.prefill_rows(tokens, cache, index, positions.to(device), last, max(ends) + 1)

    def prefill_rows(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        attn_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass of `prefill_many` on tensors only (no host work, so a CUDA graph can capture it): tokens
        (B, 1+nc, T) at positions (B, T) into cache rows `rows` (B,), attending over [0, attn_len), which must exceed
        every position. Returns the slow logits (B, vocab) and fast input hidden (B, fast_dim) at each row's token
        index `last` (B,)."""
        scratch = cache.gather(rows, attn_len)
        x = self._slow_cached(tokens, scratch, 0, positions, attn_len)
        cache.scatter(scratch, rows, attn_len)
        x = x[torch.arange(tokens.shape[0], device=tokens.device), last]
        return self.token_logits(x), self.fast_project_in(x)

    def decode_slow(
        self, frames: torch.Tensor, cache: KVCache, input_pos: torch.Tensor, attn_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One slow step for cache rows [0, B): frames (B, 1+nc) at input_pos (B,).

        Attends over positions [0, attn_len) masked by each row's own position; attn_len must exceed every
        input_pos (the engine picks a length bucket; None = the whole cache). The attention length changes
        summation order, so batch-invariant runs use one fixed length. Returns logits (B, vocab) and fast input
        hidden (B, fast_dim).
        """
        attn_len = attn_len or cache.max_seq_len
        x = self._slow_cached(frames.unsqueeze(-1), cache, 0, input_pos.unsqueeze(-1), attn_len)[:, 0]
        return self.token_logits(x), self.fast_project_in(x)

    def fast_step(self, x: torch.Tensor, fast_cache: KVCache, pos: int) -> torch.Tensor:
        """Fast stack at codebook position `pos` for rows [0, B): x (B, fast_dim) → logits (B, codebook_size).
        Attends over the whole fast cache with positions after `pos` masked (positions [0, pos] were all written
        during this frame), so every position runs the same shapes."""
        bsz = x.shape[0]
        length = fast_cache.max_seq_len
        view = fast_cache.view(0, bsz, length)
        input_pos = self.fast_positions[pos, :1].view(1, 1).expand(bsz, 1)
        mask = self.fast_causal[pos, :length].view(1, 1, 1, length).expand(bsz, 1, 1, length)
        freqs = self.fast_freqs_cis[pos : pos + 1]
        h = x.unsqueeze(1)
        for i, layer in enumerate(self.fast_layers):
            h = layer(h, freqs, view.k[i], view.v[i], input_pos, mask)
        return self.fast_logits(h[:, 0])
