"""Continuous batching of decode steps: the sequences of every request in flight decode together,
one forward a step for all of them, each over its own window.

A request thread prepares its window as today (restore, graft, prefill: the canonical, unbatched
computation, so every stored block and state keeps its bytes), then calls `greedy`
(kvmemory.decode); on a thread that serves through a Batcher (`serving`), greedy hands the
sequence to the batcher's loop and waits, releasing the Memory's lock meanwhile, so other requests
prepare or decode in between. The loop admits new sequences between steps and lets finished ones
go (continuous batching), so a long reply does not hold a short one back.

One step for B sequences: the token embeddings, every Linear, norm and MLP run over the B rows at
once; attention runs per sequence over its own cache (windows of different lengths need no
padding and no mask), each token's KV written in place into room reserved when the sequence
joins (`reserve`: no concatenation of the whole cache a step); each sequence's position is its own
cache length, as in an unbatched forward. A chat request joins with its prompt's last token not
yet computed (greedy's `feed`): that token is its first row of a step, so it shares the pass over
the weights with the others' decoding instead of taking one of its own; an ask joins the same way
with its question's tokens (several rows: that step runs through `forward_many`). Sampling is per sequence
(its own pick: greedy, temperature / top_p, its own seeded generator), and so are stop strings and
cancellation (its on_token callback).

Exactness: a step of one sequence is the model's own forward, bit for bit (on CPU with SDPA or
invariant attention the same modules run in the same order in forward_many's loop; tested; elsewhere
the model's forward itself runs). With several, each row
of a Linear is reduced by a kernel chosen for B rows, which may round differently in the last bits
than one row alone, so a greedy reply may differ from the same request served alone where two
tokens are nearly tied (measured: tests/test_batching.py, benchmarks/bench_serve.py, docs/guides/serving.md). In
invariant mode (kvmemory/model/invariant.py) every row is reduced the same way whatever B is, so a
batched step equals each sequence's step alone, bit for bit (tests/test_invariant.py).
Models other than the Llama family decode one sequence after another in the same loop."""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kvmemory.device import ids_tensor
from kvmemory.model import half
from kvmemory.model.half import NAME as HALF
from kvmemory.model.invariant import NAME as INVARIANT, linear as row_linear
from kvmemory.threads import release as release_team

_local = threading.local()


def current():
    """The Batcher serving this thread's decoding, or None."""
    return getattr(_local, "batcher", None)


@contextmanager
def let_go(lock):
    """This thread's hold on an RLock (at any depth) released for the block and taken back as it
    was after (what threading.Condition does while it waits): others run model work meanwhile."""
    held = lock._release_save() if lock._is_owned() else None
    try:
        yield
    finally:
        if held is not None:
            lock._acquire_restore(held)


def serving(batcher) -> None:
    """Make this thread's greedy() decode through `batcher` (None: decode alone again)."""
    _local.batcher = batcher


class _Seq:
    __slots__ = ("cache", "logits", "max_new", "eos", "on_token", "pick", "new", "next", "error", "done", "first")

    def __init__(self, cache, logits, max_new, eos, on_token, pick, first=None) -> None:
        self.cache, self.logits, self.max_new, self.eos = cache, logits, max_new, eos
        self.on_token, self.pick, self.first = on_token, pick, first
        self.new: list[int] = []
        self.next: int | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def push(self, logits: torch.Tensor) -> bool:
        """Choose the next token from `logits`; True when it needs a forward (greedy()'s rules)."""
        if self.first is not None and not self.first:
            self.first.append(logits.clone())
        nxt = self.pick(logits)
        if nxt in self.eos or len(self.new) >= self.max_new:
            return False
        self.new.append(nxt)
        if self.on_token is not None and self.on_token(self.new):
            return False
        if len(self.new) == self.max_new:
            return False
        self.next = nxt
        return True


# decoder layers whose forward is exactly the loop of forward_many (norm, q/k/v with optional bias,
# rotate-half RoPE over the whole head, attention, o_proj, residual, norm, gated MLP, residual) in
# models whose forward adds nothing around them (Gemma's embedding scale lives in its embedding module);
# another family's layers (Granite's multipliers, QK-norm, fused projections, partial rotary) run the
# model's own forward per sequence instead (exact, not batched). tests/model/test_conformance.py holds
# each family's batched pass to its sequences alone.
BATCHED_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer", "GemmaDecoderLayer",
                  "OlmoDecoderLayer")


def llama_like(model) -> bool:
    """Whether the batched step knows this model's layers (Llama, SmolLM, Qwen2, Mistral, Gemma, OLMo)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    a, l0 = getattr(layers[0], "self_attn", None), layers[0]
    if any(type(layer).__name__ not in BATCHED_LAYERS for layer in layers):
        return False
    return (a is not None and all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
            and all(hasattr(l0, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp"))
            and all(hasattr(l0.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            and not hasattr(a, "q_norm") and not getattr(model.config, "sliding_window", None))


LOOP_ALONE = ("sdpa", HALF, INVARIANT)   # attentions whose one-sequence forward_many on CPU is the model's forward


def step(model, caches: list, tokens: list[int], rows: tuple | None = None) -> list[torch.Tensor]:
    """One decode step: token i appended to caches[i] (each extended in place, into its reserved
    room where it has one); -> the next logits [vocab] of each. One sequence: the model's own
    forward. A forward_many of one token per sequence."""
    return [lg[-1] for lg in forward_many(model, caches, [[t] for t in tokens], [1] * len(tokens), rows)]


@torch.inference_mode()
def forward_many(model, caches: list, ids: list[list[int]], keep: list[int],
                 rows: tuple | None = None) -> list[torch.Tensor]:
    """Several sequences' tokens in one pass over the weights: ids[i] ([T_i] token ids) run after
    caches[i] (each extended in place), as a prefill of each alone would; -> per sequence the
    logits of its last keep[i] positions [keep_i, vocab].

    The rows of every sequence go through each Linear, norm and MLP together; attention runs per
    sequence over its own cache (causal among its new tokens), at its own positions. One
    sequence: the model's own forward, bit for bit: on CPU with the attention of LOOP_ALONE, the
    same modules in the same order here (tested: logits and KV equal), so its KV goes into its
    reserved room instead of a concatenation of the whole cache (9-17% of a step for
    300-2,000-token windows); elsewhere (another attention, or a GPU, where SDPA given a mask may
    pick another kernel than given is_causal), or for a model the batched step does not know, the
    model's own forward itself. Several: a sequence's rows may round differently in the last bits than its
    prefill alone (the GEMM's kernel depends on the row count), deterministically for the same
    inputs; in invariant mode (kvmemory/model/invariant.py) they are its prefill alone, bit for bit.

    rows: a row scheme of kvmemory.model.invariant (`choose`): every Linear product of the pass
    reduces each row the same way whatever the number of rows (few rows padded with zero rows), so
    a sequence's logits and KV are the same bits in any batch as through this loop alone (its
    attention runs per sequence either way); not the model's own forward then (a one-row product
    is padded). With the model's attention, not invariant mode's: a chunked prefill still rounds
    unlike one pass."""
    if len(caches) != len(ids) or len(ids) != len(keep) or any(not t for t in ids) or any(
            not 1 <= k <= len(t) for k, t in zip(keep, ids)):
        raise ValueError("forward_many: one non-empty token list and 1 <= keep <= its length per cache")
    impl = model.config._attn_implementation
    if not llama_like(model) or (len(caches) == 1 and rows is None and (impl not in LOOP_ALONE
                                                                         or model.device.type != "cpu")):
        return [model(input_ids=ids_tensor(t, model), past_key_values=c, use_cache=True,
                      logits_to_keep=k).logits[0] for c, t, k in zip(caches, ids, keep)]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    inner, dev = model.model, model.device
    lens = [c.get_seq_length() for c in caches]
    sizes = [len(t) for t in ids]
    offs = [sum(sizes[:b]) for b in range(len(sizes))]
    x = inner.embed_tokens(torch.tensor([[t for seq in ids for t in seq]], dtype=torch.long, device=dev))
    pos = torch.tensor([[n + j for n, T in zip(lens, sizes) for j in range(T)]], dtype=torch.long, device=dev)
    cos, sin = inner.rotary_emb(x, pos)                                     # [1, R, D]
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
    masks = [None if impl == INVARIANT or T == 1 else
             torch.ones(T, n + T, dtype=torch.bool, device=dev).tril(diagonal=n)[None, None]
             for n, T in zip(lens, sizes)]
    R = x.shape[1]
    rooms = [_room(c, n, T) for c, n, T in zip(caches, lens, sizes)]
    if rows is None:
        def lin(mod, h):
            return mod(h)
    else:                 # every row reduced the same way whatever the number of rows
        def lin(mod, h):
            return row_linear(h, mod.weight, mod.bias, rows)
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (1, R, -1, a.head_dim)
        q = lin(a.q_proj, h).view(shape).transpose(1, 2)                    # [1, H, R, D]
        k = lin(a.k_proj, h).view(shape).transpose(1, 2)
        v = lin(a.v_proj, h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if impl == HALF:                # every sequence's queries in float32 at once (exact: the same numbers)
            q32 = q.float()
        outs = []
        for b, c in enumerate(caches):
            sl = slice(offs[b], offs[b] + sizes[b])
            if rooms[b] is not None:                                        # written in place, no copy
                kb, vb = _put(c.layers[i], rooms[b][i], lens[b], k[:, :, sl], v[:, :, sl])
            else:
                kb, vb = c.update(k[:, :, sl].contiguous(), v[:, :, sl].contiguous(), i)
            if impl == "sdpa":          # the heads shared in the kernel: no copy of the keys per query head
                o = F.scaled_dot_product_attention(q[:, :, sl], kb, vb, attn_mask=masks[b], scale=a.scaling,
                                                   enable_gqa=True).transpose(1, 2)
            elif impl == HALF:          # a half-precision model's, in float32 (kvmemory/model/half.py)
                o = half.sdpa32(q32[:, :, sl], kb, vb, masks[b], a.scaling)
            else:
                o, _ = attend(a, q[:, :, sl], kb, vb, masks[b], dropout=0.0, scaling=a.scaling)
            outs.append(o)                                                  # [1, T_b, Hq, D]
        o = torch.cat(outs, dim=1).reshape(1, R, -1)
        o = o.to(x.dtype) if impl == HALF else o.contiguous()                # (to() rounds each number alone)
        x = x + lin(a.o_proj, o)
        m, h = layer.mlp, layer.post_attention_layernorm(x)                 # LlamaMLP.forward, its ops in order
        x = x + lin(m.down_proj, m.act_fn(lin(m.gate_proj, h)) * lin(m.up_proj, h))
    kept = [r for b in range(len(ids)) for r in range(offs[b] + sizes[b] - keep[b], offs[b] + sizes[b])]
    logits = lin(model.lm_head, inner.norm(x[:, kept]))[0]                  # [sum keep, vocab]
    return list(torch.split(logits, keep))


def reserve(cache, extra: int) -> None:
    """Room for `extra` more tokens in every layer of a DynamicCache: buffers [1, H, T + extra, D]
    holding its KV, the layers' keys and values made views of their first T tokens. A batched
    step then writes a token's KV in place (`_put`) instead of concatenating the whole cache
    again (torch.cat was 45% of a step of 8 sequences with 300-1,800-token windows). The values
    are the same (a view of the same numbers); a forward of the model's own (a step of one) appends
    as always, and the room is taken again at the next batched step."""
    if extra < 1 or not getattr(cache, "layers", None) or not all(
            getattr(layer, "keys", None) is not None and hasattr(layer, "values") for layer in cache.layers):
        return
    if _room(cache, cache.layers[0].keys.shape[-2], extra) is not None:
        return                                   # built with room enough (room_of): nothing to copy
    room = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        T = k.shape[-2]
        kb = k.new_empty((*k.shape[:-2], T + extra, k.shape[-1]))
        vb = v.new_empty((*v.shape[:-2], T + extra, v.shape[-1]))
        kb[..., :T, :] = k
        vb[..., :T, :] = v
        layer.keys, layer.values = kb[..., :T, :], vb[..., :T, :]
        room.append((kb, vb))
    cache._kvmemory_room = room


def room_of(cache, buf: torch.Tensor) -> None:
    """Mark buf [L, 2, H, T + extra, D] (whose first T tokens the cache's layers view, as
    kv.make_cache(buf[:, :, :, :T], copy=False) makes them) as the cache's reserved room (what
    `reserve` allocates): a batched step or forward_many writes the next tokens' KV in place
    instead of concatenating the whole window again (the re-rank's windows are built so)."""
    if len(cache.layers) == buf.shape[0]:
        cache._kvmemory_room = [(buf[i, 0].unsqueeze(0), buf[i, 1].unsqueeze(0)) for i in range(buf.shape[0])]


def _room(cache, n: int, need: int = 1):
    """The cache's reserved buffers if every layer still is a view of them holding n tokens with
    room for `need` more (a forward of the model's own replaces the views with new tensors: then
    the buffers take the layers' KV again, once), else None (the cache appends as always)."""
    room = getattr(cache, "_kvmemory_room", None)
    if room is None or len(room) != len(cache.layers) or room[0][0].shape[-2] < n + need:
        return None
    for layer, (kb, vb) in zip(cache.layers, room):
        if layer.keys.shape[-2] != n:
            return None
        if layer.keys.data_ptr() != kb.data_ptr() or layer.values.data_ptr() != vb.data_ptr():
            kb[..., :n, :] = layer.keys
            vb[..., :n, :] = layer.values
            layer.keys, layer.values = kb[..., :n, :], vb[..., :n, :]
    return room


def _put(layer, buffers, n: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens n.. k, v [1, H, T, D] written into the layer's reserved buffers; -> its keys, values."""
    kb, vb = buffers
    T = k.shape[-2]
    kb[..., n:n + T, :] = k
    vb[..., n:n + T, :] = v
    layer.keys, layer.values = kb[..., :n + T, :], vb[..., :n + T, :]
    return layer.keys, layer.values


class Batcher:
    """One decode loop for `model`: sequences from any thread decode together, at most max_batch at
    a step (the rest wait for a place). `lock` (the Memory's) is held for each step and released by
    a thread while it waits for its sequence."""

    def __init__(self, model, lock, max_batch: int = 8, invariant_rows: bool = False) -> None:
        """invariant_rows: every Linear of a step reduces each row the same way whatever the number
        of rows (the machine's row scheme, kvmemory.model.invariant.choose; InvariantUnavailableError
        where it has none, ValueError for a model the batched step does not know), so a sequence
        decodes the same tokens in any batch as alone through this loop (forward_many's `rows`)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.lock, self.max_batch = model, lock, max_batch
        self.scheme = None
        if invariant_rows:
            if not llama_like(model):
                raise ValueError(f"invariant_rows: the batched step does not know {type(model).__name__}'s layers")
            from kvmemory.model.invariant import choose
            self.scheme = choose(model)
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self.steps = 0
        self.rows = 0                     # sequences x steps: rows / steps is the mean batch
        self.widest = 0

    def decode(self, cache, logits, max_new_tokens: int, eos, on_token=None, pick=None, feed=None,
               first=None) -> list[int]:
        """greedy()'s contract, decoded in the shared loop; blocks until this sequence is done.
        logits None: `feed` (the prompt's last token, or a list of its last tokens) is the
        sequence's first row(s) of a step (a list: a step through forward_many)."""
        seq = _Seq(cache, logits, max_new_tokens, eos, on_token, pick or (lambda x: int(x.argmax())), first)
        if logits is None:
            seq.next = feed
        self._ensure()
        with let_go(self.lock):
            self._q.put(seq)
            seq.done.wait()
        if seq.error is not None:
            raise seq.error
        return seq.new

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _ensure(self) -> None:
        with self._start:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="kvmemory-decode", daemon=True)
                self._thread.start()

    def _admit(self, seq, active: list) -> None:
        if seq.logits is None:                 # its prompt's last token(s) first
            reserve(seq.cache, seq.max_new + (len(seq.next) if isinstance(seq.next, list) else 0))
            active.append(seq)
            return
        try:
            needs = seq.push(seq.logits)
        except BaseException as e:        # noqa: BLE001 -- the request's own callback failed
            seq.error = e
            needs = False
        seq.logits = None
        if needs:
            reserve(seq.cache, seq.max_new - len(seq.new))
            active.append(seq)
        else:
            seq.done.set()

    def _loop(self) -> None:
        active: list[_Seq] = []
        waiting: list[_Seq] = []
        while True:
            try:
                block = not active and not waiting
                if block:
                    release_team()    # idle: no OpenMP team of this thread beside those working (kvmemory/threads.py)
                while True:
                    item = self._q.get(block=block)
                    if item is None:
                        for s in active + waiting:
                            s.error = RuntimeError("the decoder was closed")
                            s.done.set()
                        return
                    waiting.append(item)
                    block = False
            except queue.Empty:
                pass
            while waiting and len(active) < self.max_batch:
                self._admit(waiting.pop(0), active)
            if not active:
                continue
            try:
                with self.lock:
                    # a prompt's last tokens (a list) are that sequence's rows of the same pass
                    out = [lg[-1] for lg in forward_many(self.model, [s.cache for s in active],
                                                         [s.next if isinstance(s.next, list) else [s.next]
                                                          for s in active], [1] * len(active), self.scheme)]
            except BaseException as e:    # noqa: BLE001 -- every sequence of the step learns it
                for s in active:
                    s.error = e
                    s.done.set()
                active = []
                continue
            self.steps += 1
            self.rows += len(active)
            self.widest = max(self.widest, len(active))
            still = []
            for s, lg in zip(active, out):
                try:
                    go = s.push(lg)
                except BaseException as e:  # noqa: BLE001
                    s.error, go = e, False
                if go:
                    still.append(s)
                    if getattr(s.cache, "_kvmemory_room", None) is None:
                        # it joined with an empty cache (a prompt fed whole): room from its next step on
                        reserve(s.cache, s.max_new - len(s.new))
                else:
                    s.done.set()
            active = still
