"""The talker's code predictor: one frame's 15 residual codes from the talker's hidden state and
the frame's layer-0 code (docs/qwen3-omni.md, "One frame").

A fresh cache per frame: prefill [talker hidden, layer-0 code embedding], then one single-token
step per residual code but the last; each picked code's embedding is summed with the others into
the talker's next input. The same loop serves the eager step (per-row picks on the host, so
sampling requests can share the batch) and the CUDA graph of a whole greedy frame
(services/talker/graphs.py), so the two cannot drift apart.

NOTE: lean loop. `generate` runs the predictor's whole transformers forward 15 times per frame
(config-default merging, output capturing, mask creation, output dataclasses, a DynamicCache).
`CodePredictor` runs the same tensor ops in the same order on the same shapes, straight on the
modules' weights: RMSNorm as `Qwen3OmniMoeRMSNorm.forward`, the projections through `F.linear`
(so `batch_invariant` still applies), rotary cos/sin computed once per position by the module's
own `rotary_emb` (the same call on the same position ids each frame, so the same bits), SDPA as
transformers' `sdpa_attention_forward` calls it (no mask, causal for the 2-token prefill, GQA in
the kernel), lm heads over every position of the forward as the module does. Keys and values go
into buffers allocated once, at [batch, kv_heads, position] slices: nothing is allocated or
registered per step beyond the op results.

All rows of a frame sit at the same position, so attention can run as one batched SDPA over
[B, heads, T, head_dim]. Whether that gives each row its B = 1 bits is a property of the CPU's
SDPA kernel (it did on an Intel host; on AMD hosts at 2 threads it did not), so in exact mode the
batched call is used only where the start-up check found it invariant for these shapes
(services/runtime/lm/invariance.py, `ExactKernels.attention`); otherwise one SDPA per row, with the
shape `generate`'s predictor gives it. The projections go along the process's exact linear path
(ROWS, checked BATCHED bmm, or GEMM). `tests/talker` compares every frame with `generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from services.runtime.lm.invariance import AttentionShape
from services.runtime.lm.kernels import KernelPath, batch_invariant, exact_kernels, exact_linear, fused_rms_norm, row_alone


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    # Qwen3OmniMoeRMSNorm.forward, op for op.
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CodePredictor:
    """The lean per-frame loop over preallocated keys and values for up to `capacity` rows."""

    def __init__(self, talker, capacity: int, device, dtype, batched_attention: bool | None = None,
                 fused: bool = False):
        predictor = talker.code_predictor
        self.talker = talker
        self.model = predictor.model
        self.lm_heads = [head.weight for head in predictor.lm_head]
        self.embeddings = [e.weight for e in predictor.get_input_embeddings()]
        self.layers = list(self.model.layers[: self.model.config.num_hidden_layers])
        config = predictor.config
        self.num_groups = int(talker.config.num_code_groups)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.gqa = self.heads != self.kv_heads
        if any(t != "full_attention" for t in config.layer_types) or config.attention_dropout or config.attention_bias:
            raise ValueError("the lean code predictor covers full attention without dropout or biases only")
        # Batched SDPA in exact mode: where the process's check found it invariant (None: decided per
        # call from `exact_kernels()`), or where the caller says (the CUDA graph of a frame has
        # always run one batched SDPA).
        self.batched_attention = batched_attention
        # [capacity, kv_heads, positions, head_dim] per layer: 1 hidden + num_groups - 1 fed codes.
        shape = (capacity, self.kv_heads, self.num_groups + 1, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.capacity = capacity
        # cos/sin per forward of a frame, as the model computes them: prefill positions [[0, 1]],
        # then [[step + 1]] (past_seen_tokens + arange(1)).
        # Kept as [1, T, 1, head_dim]: they multiply q and k in their [B, T, heads, head_dim] layout.
        with torch.inference_mode():
            probe = torch.zeros((1, 1, config.hidden_size), dtype=dtype, device=device)
            positions = [torch.arange(2, device=device).unsqueeze(0)]
            positions += [torch.tensor([[step + 1]], device=device) for step in range(1, self.num_groups - 1)]
            self.rope = [tuple(t.unsqueeze(2) for t in self.model.rotary_emb(probe, p)) for p in positions]
            # q_norm and k_norm as one RMSNorm over q's and k's heads side by side: the per-head
            # reduction and the elementwise ops give each element what the two norms give it.
            self.qk_norm = []
            for layer in self.layers:
                attn = layer.self_attn
                if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
                    raise ValueError("q_norm and k_norm with different epsilons")
                weight = torch.cat((attn.q_norm.weight.expand(self.heads, -1), attn.k_norm.weight.expand(self.kv_heads, -1)))
                self.qk_norm.append(SimpleNamespace(weight=weight, variance_epsilon=attn.q_norm.variance_epsilon))
        self.fused = fused
        if fused:
            self._fuse()

    def _fuse(self) -> None:
        """The graph path's frame in fewer kernels, on the same weights: q, k and v one projection and
        gate and up another (each layer's weights concatenated once, the modules' own weights then views
        of them: no second copy), every RMSNorm one `F.rms_norm`, rotate-half as one roll against a sine
        with its first half negated (the same products: -x * s = x * -s). Not exact mode's bits (the
        norms round once, a concatenated GEMM may sum in another order): CUDA graphs only, where exact
        batching is off."""
        self.qkv, self.gate_up = [], []
        with torch.no_grad():
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.qkv.append(_concatenated(attn.q_proj, attn.k_proj, attn.v_proj))
                self.gate_up.append(_concatenated(mlp.gate_proj, mlp.up_proj))
        half = self.head_dim // 2
        self.rope = [(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)) for cos, sin in self.rope]

    def attention_shapes(self) -> list[AttentionShape]:
        """The batched SDPAs of one frame: the 2-token causal prefill, then one token over 3..groups."""
        shape = dict(heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim, positions=self.num_groups + 1)
        return [AttentionShape(**shape, tokens=2, length=2, causal=True)] + [
            AttentionShape(**shape, tokens=1, length=length, causal=False) for length in range(3, self.num_groups + 1)]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, exact: bool) -> torch.Tensor:
        """F.linear without bias; in exact mode along the process's exact linear path
        (services/runtime/lm/kernels.py, `exact_linear`)."""
        if not exact:
            return F.linear(x, weight)
        return exact_linear(x, weight)

    def _attention(self, index: int, attn, x: torch.Tensor, cos, sin, start: int, exact: bool,
                   exact_rows: bool) -> torch.Tensor:
        # Qwen3OmniMoeTalkerCodePredictorAttention.forward + sdpa_attention_forward: q and k side
        # by side along the heads for their norm and rotary (elementwise and per-head: the same bits).
        batch, tokens = x.shape[:2]
        heads, dim = self.heads, self.head_dim
        if self.fused:
            return self._fused_attention(index, attn, x, cos, sin, start)
        qk = torch.cat((self._linear(x, attn.q_proj.weight, exact).view(batch, tokens, heads, dim),
                        self._linear(x, attn.k_proj.weight, exact).view(batch, tokens, self.kv_heads, dim)), dim=2)
        qk = _rms_norm(self.qk_norm[index], qk)
        qk = (qk * cos) + (_rotate_half(qk) * sin)
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
        v = self._linear(x, attn.v_proj.weight, exact).view(batch, tokens, self.kv_heads, dim).transpose(1, 2)
        end = start + tokens
        keys, values = self.keys[index][:batch], self.values[index][:batch]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        keys, values = keys[:, :, :end], values[:, :, :end]
        causal = tokens > 1
        attend = partial(F.scaled_dot_product_attention, dropout_p=0.0, scale=attn.scaling, is_causal=causal,
                         enable_gqa=self.gqa)
        if batch == 1:  # the row's own call
            out = row_alone(attend, q, keys, values)
        elif exact_rows:
            out = torch.cat([row_alone(attend, q[i:i + 1], keys[i:i + 1], values[i:i + 1]) for i in range(batch)])
        else:
            out = attend(q, keys, values)
        out = out.transpose(1, 2).contiguous().reshape(batch, tokens, -1).contiguous()
        return self._linear(out, attn.o_proj.weight, exact)

    def _fused_attention(self, index: int, attn, x: torch.Tensor, cos, sin_signed, start: int) -> torch.Tensor:
        """`_attention` of the fused frame (`_fuse`): one batched SDPA, 12 ops a layer."""
        batch, tokens = x.shape[:2]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv[index]).view(batch, tokens, heads + 2 * kv_heads, dim)
        norm = self.qk_norm[index]
        qk = F.rms_norm(qkv[:, :, :heads + kv_heads], (dim,), None, norm.variance_epsilon) * norm.weight
        qk = qk * cos + torch.roll(qk, dim // 2, dims=-1) * sin_signed
        end = start + tokens
        keys, values = self.keys[index][:batch], self.values[index][:batch]
        keys[:, :, start:end] = qk[:, :, heads:].transpose(1, 2)
        values[:, :, start:end] = qkv[:, :, heads + kv_heads:].transpose(1, 2)
        out = F.scaled_dot_product_attention(qk[:, :, :heads].transpose(1, 2), keys[:, :, :end], values[:, :, :end],
                                             dropout_p=0.0, scale=attn.scaling, is_causal=tokens > 1,
                                             enable_gqa=self.gqa)
        return F.linear(out.transpose(1, 2).reshape(batch, tokens, -1), attn.o_proj.weight)

    def _forward(self, hidden: torch.Tensor, step: int, start: int, exact: bool, exact_rows: bool) -> torch.Tensor:
        """One forward of the predictor over hidden [B, T, H] at cache position `start`; the
        logits of lm head `step` at the last position, [B, vocab]."""
        cos, sin = self.rope[0 if start == 0 else step]
        norm = fused_rms_norm if self.fused else _rms_norm
        for index, layer in enumerate(self.layers):
            residual = hidden
            x = norm(layer.input_layernorm, hidden)
            hidden = residual + self._attention(index, layer.self_attn, x, cos, sin, start, exact, exact_rows)
            residual = hidden
            x = norm(layer.post_attention_layernorm, hidden)
            hidden = residual + self._mlp(index, layer.mlp, x, exact)
        hidden = norm(self.model.norm, hidden)
        return self._linear(hidden, self.lm_heads[step], exact)[:, -1]

    def _mlp(self, index: int, mlp, x: torch.Tensor, exact: bool) -> torch.Tensor:
        if self.fused:
            gate, up = F.linear(x, self.gate_up[index]).chunk(2, dim=-1)
            return F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight)
        return self._linear(mlp.act_fn(self._linear(x, mlp.gate_proj.weight, exact))
                            * self._linear(x, mlp.up_proj.weight, exact), mlp.down_proj.weight, exact)

    def __call__(self, past_hidden: torch.Tensor, codes0: torch.Tensor,
                 pick: Callable[[torch.Tensor], torch.Tensor], exact: bool):
        """past_hidden [B, 1, H] talker hidden; codes0 [B, 1] layer-0 codes; `pick`: logits
        [B, vocab] -> ids [B] on the model's device.
        Returns (codes [B, num_code_groups], sum of the codes' embeddings [B, 1, H])."""
        batch = codes0.shape[0]
        if batch > self.capacity:
            raise ValueError(f"{batch} rows exceed the code predictor's {self.capacity}")
        batched = self.batched_attention
        if batched is None:
            batched = exact_kernels().attention is KernelPath.BATCHED
        exact_rows = exact and not batched
        first = self.talker.get_input_embeddings()(codes0)  # [B, 1, H]
        columns, hiddens = [codes0[:, 0]], [first]
        with batch_invariant(exact):
            logits = self._forward(torch.cat((past_hidden, first), dim=1), 0, 0, exact, exact_rows)
            for step in range(1, self.num_groups):
                ids = pick(logits).view(-1, 1)  # [B, 1]
                columns.append(ids[:, 0])
                embedded = F.embedding(ids, self.embeddings[step - 1])
                hiddens.append(embedded)
                if step < self.num_groups - 1:
                    logits = self._forward(embedded, step, step + 1, exact, exact_rows)
        return torch.stack(columns, dim=1), torch.cat(hiddens, dim=1).sum(1, keepdim=True)


def _concatenated(*projections) -> torch.Tensor:
    """The projections' weights [out_i, in] as one [sum out_i, in] tensor, each module's weight then
    a view of its rows (the same values, stored once)."""
    weight = torch.cat([p.weight for p in projections])
    start = 0
    for p in projections:
        rows = p.weight.shape[0]
        p.weight.data = weight[start:start + rows]
        start += rows
    return weight


def predict_frame(talker, past_hidden: torch.Tensor, codes0: torch.Tensor, cache,
                  pick: Callable[[torch.Tensor], torch.Tensor], exact: bool):
    """The same frame through transformers' own predictor forward (the slow path the lean loop
    replaces; kept as the reference the tests compare `CodePredictor` with).
    `cache`: `past_key_values` of a fresh cache per row, advanced by `cache.commit()`."""
    predictor = talker.code_predictor
    embeddings = predictor.get_input_embeddings()  # num_code_groups - 1 tables
    num_groups = int(talker.config.num_code_groups)
    first = talker.get_input_embeddings()(codes0)  # [B, 1, H]
    columns, hiddens = [codes0[:, 0]], [first]
    with batch_invariant(exact):
        out = predictor(inputs_embeds=torch.cat((past_hidden, first), dim=1), past_key_values=cache, use_cache=True)
        cache.commit()
        for step in range(1, num_groups):
            ids = pick(out.logits[:, -1]).view(-1, 1)  # [B, 1]
            columns.append(ids[:, 0])
            hiddens.append(embeddings[step - 1](ids))
            if step < num_groups - 1:
                out = predictor(input_ids=ids, past_key_values=cache, use_cache=True, generation_steps=step)
                cache.commit()
    return torch.stack(columns, dim=1), torch.cat(hiddens, dim=1).sum(1, keepdim=True)
