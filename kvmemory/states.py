"""States: a prompt's KV computed once, committed as a chain of content-addressed blocks, restored
bit-exactly (save / load / resolve / forget / list), and E2 (every stored block recomputed from
its tokens and parent context, compared byte for byte).

`States` needs the model and a store, nothing else of the Memory that wires it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import xxhash

from kvmemory import hashing, kv as kvops
from kvmemory.device import ids_tensor, to_host, to_model
from kvmemory.errors import InputError, StateNotFoundError, StoreCorruptError, StoreError, WindowExceededError
from kvmemory.model import invariant as invariant_ops
from kvmemory.store import Change
from kvmemory.store.manifest import StateEntry


@dataclass(frozen=True)
class StateInfo:
    id: str
    n_tokens: int
    label: str
    created: float


class State:
    """A restorable attention state: a chain of blocks from position 0.

    id: content address (hex of the last block id). token_ids: the tokens it covers.
    kv: [layers, 2, kv_heads, n_tokens, head_dim] in the model's dtype (verified on load).
    """

    def __init__(self, id: str, token_ids: list[int], kv: torch.Tensor, config, label: str = "",
                 device: torch.device | str = "cpu") -> None:
        self.id = id
        self.token_ids = token_ids
        self.kv = kv
        self.label = label
        self._config = config
        self._device = torch.device(device)
        self.reused_tokens = 0          # save(): how many of its tokens came from the store
        # from a compact store: the measured error of its blocks against their exact KV (None: exact)
        self.encoding_error: dict | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def cache(self):
        """A new transformers DynamicCache holding this state on the model's device; the model may extend it."""
        kv = self.kv if self.kv.device == self._device else self.kv.to(self._device)
        return kvops.make_cache(kv, self._config, copy=False)   # views of kv: the model never writes them

    def __repr__(self) -> str:
        return f"State(id={self.id[:16]}…, n_tokens={self.n_tokens}, label={self.label!r})"


def token_ids(tokenizer, vocab: int, text_or_ids) -> list[int]:
    """Token ids of a prompt: str (UTF-8 text), bytes (must decode as UTF-8) or a list of ids in 0..vocab-1."""
    if isinstance(text_or_ids, (bytes, bytearray)):
        try:
            text_or_ids = bytes(text_or_ids).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"input is not UTF-8 text: byte 0x{text_or_ids[e.start]:02x} at offset {e.start}") from None
    if isinstance(text_or_ids, str):
        if not text_or_ids.strip():
            raise InputError("input text is empty")
        ids = tokenizer(text_or_ids, add_special_tokens=False)["input_ids"]
    else:
        try:
            ids = [int(i) for i in text_or_ids]
        except (TypeError, ValueError):
            raise InputError(f"expected text or a list of token ids, got {type(text_or_ids).__name__}") from None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise InputError(f"token ids must be in 0..{vocab - 1}; got {bad[:5]}")
    if not ids:
        raise InputError("input has no tokens")
    return ids


def state_id_of(last_block: bytes, owner: str | None) -> str:
    """A state's id: its last block's id, or for an owner's state that id keyed by the owner (an entry
    of the owner's own, never another's)."""
    return last_block.hex() if owner is None else xxhash.xxh3_128_hexdigest(f"{owner}:{last_block.hex()}".encode())


class States:
    """The states of one store, computed with one model. require_store() -> the open BlockStore."""

    def __init__(self, require_store, model, tokenizer, fingerprint: str, geometry, kv_dtype: torch.dtype,
                 location: str) -> None:
        self.require_store, self.model, self.tokenizer = require_store, model, tokenizer
        self.fingerprint, self.geometry, self.kv_dtype, self.location = fingerprint, geometry, kv_dtype, location

    def tokenize(self, text_or_ids) -> list[int]:
        return token_ids(self.tokenizer, self.model.get_input_embeddings().num_embeddings, text_or_ids)

    def check_window(self, n: int, what: str) -> None:
        if n > self.geometry.max_positions:
            raise WindowExceededError(
                f"{what} is {n} tokens, longer than the model's window of {self.geometry.max_positions}; "
                "split it, or deposit it as a document")

    def save(self, text_or_ids, label: str = "", owner: str | None = None) -> State:
        """Compute (or reuse) the KV of a prompt and commit it as a state. Returns the State.

        Blocks already in the store (equal prefixes) are read back, verified, and not
        recomputed. The commit is atomic: a crash leaves the store at its previous commit.
        """
        store = self.require_store()
        ids = self.tokenize(text_or_ids)
        self.check_window(len(ids), "the state")
        C = store.manifest.block_tokens
        # an owner's chain is salted: its ids are no other owner's, so another user's equal prefix is
        # never found here (no cache hit, no shorter commit), only the owner's own blocks are
        root = hashing.ROOT_PARENT if owner is None else store.owner_root(owner)
        chain = hashing.chain_ids(self.fingerprint, ids, C, parent=root)
        store.refresh()
        have = 0
        while have < len(chain) and store.row_of(chain[have]) is not None:
            have += 1
        if have < len(chain):
            store.require_exact()            # a compact store takes no new blocks (before any prefill)
        Q = store.manifest.chunk_tokens
        part, part_row = self._stored_part(store, ids, chain, have, root) if have < len(chain) else (0, None)
        prefix = self.read_chain([store.row_of(b) for b in chain[:have]] + ([part_row] if part else []))
        prefix = prefix[:, :, :, :have * C + part]          # a partial block's usable start (prefill_tokens)
        computed: dict[int, torch.Tensor] = {}
        reused = min(have * C + part, len(ids))
        if have < len(chain):
            cache = kvops.make_cache(to_model(prefix, self.model), self.model.config)
            pos = have * C + part
            if part:             # the rest of the partly stored block, then block by block as always
                kvops.prefill_chunked(self.model, ids_tensor(ids[pos:(have + 1) * C], self.model), cache, Q)
                computed[have] = to_host(kvops.cache_slice(cache, have * C, cache.get_seq_length()))
                prefix, pos = prefix[:, :, :, :have * C], min(len(ids), (have + 1) * C)
            for p, block_kv, _ in kvops.prefill_blocks(self.model, ids[pos:], C, cache, pos, Q):
                computed[p // C] = to_host(block_kv)
        # an owner's state is an entry of its own (its id keyed by the owner), never another's
        state_id = state_id_of(chain[-1], owner)

        def kv_of(i: int):
            return kvops.to_storage(computed[i] if i in computed else prefix[:, :, :, i * C:(i + 1) * C])

        def build(s):
            new, rows = s.plan_chain(chain, ids, 0, -1, kv_of, root, owner)   # another writer may have committed some
            have = s.manifest.states.get(state_id)
            if not new and have is not None and (not label or have.label == label):
                return Change()                      # already stored as asked: no commit
            return Change(new, {state_id: StateEntry(last_row=rows[-1], n_tokens=len(ids), label=label,
                                                     created=time.time())})

        store.commit(build)
        parts = [prefix] + [computed[i] for i in sorted(computed)]
        kv = torch.cat(parts, dim=3) if len(parts) > 1 else prefix
        st = State(state_id, ids, kv, self.model.config, label, self.model.device)
        st.reused_tokens = reused          # tokens read back from the store instead of computed
        st.encoding_error = store.error_report([store.row_of(b) for b in chain])
        return st

    def _stored_part(self, store, ids: list[int], chain: list[bytes], have: int, root: bytes) -> tuple[int, int | None]:
        """How much of the first missing block the store already holds, computed as canonical, as
        (tokens, row of the stored block that holds them); (0, None) if none. The stored block is a
        shorter state's last, partial block (the previous turn of a conversation): the longest one
        that starts the missing block is found by its id. Its tokens then are restored, not computed
        again:
        - in invariant mode, all of them: the invariant kernels give a token the same KV bytes however
          the pass that computes it is chunked (kvmemory/model/invariant.py);
        - in a store with prefill_tokens Q < block_tokens, its whole forwards of Q (the first
          floor(n / Q) * Q tokens): the canonical prefill computes every block as forwards of Q from
          its start, so those forwards are the same computation in the longer block.
        With the default kernels and one forward a block, a block is computed whole (E2)."""
        C, Q = store.manifest.block_tokens, store.manifest.chunk_tokens
        invariant = invariant_ops.installed(self.model)
        if not invariant and Q >= C:
            return 0, None
        start = have * C
        parent = chain[have - 1] if have else root
        for n in range(min(C, len(ids) - start) - 1, 0 if invariant else Q - 1, -1):           # longest first
            row = store.row_of(hashing.block_id(self.fingerprint, parent, ids[start:start + n],
                                                range(start, start + n)))
            if row is not None:
                return (n if invariant else n // Q * Q), row
        return 0, None

    def read_chain(self, rows: list[int]) -> torch.Tensor:
        """Verified KV of a chain of committed rows: [layers, 2, kv_heads, tokens, head_dim]."""
        kv = kvops.from_storage(self.require_store().read_state_kv(rows), self.kv_dtype)
        kvops.check_geometry(kv, self.geometry)
        return kv

    def resolve(self, state_id: str) -> str:
        """Full id of a committed state given its id or a unique prefix of >= 8 hex digits."""
        store = self.require_store()
        store.refresh()
        if not isinstance(state_id, str) or not state_id:
            raise InputError(f"a state id is a hex string, got {state_id!r}")
        states = store.manifest.states
        if state_id in states:
            return state_id
        if len(state_id) >= 8:
            hits = [s for s in states if s.startswith(state_id.lower())]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise InputError(f"state id prefix {state_id} is ambiguous: {len(hits)} states match")
        raise StateNotFoundError(f"no state {state_id} in store {self.location}")

    def load(self, state_id: str) -> State:
        """Verified read of a committed state: every block digest-checked, ids re-derived."""
        store = self.require_store()
        sid = self.resolve(state_id)
        entry = store.manifest.states[sid]
        rows = store.chain(entry.last_row)
        meta = store.block_meta(rows)
        ids: list[int] = []
        for toks, n in zip(meta["tokens"], meta["n_tokens"]):
            ids.extend(int(t) for t in toks[:n])
        # the chain's ids are hashes of its tokens: a damaged token array cannot pass this
        expect = hashing.chain_ids(self.fingerprint, ids, store.manifest.block_tokens,
                                   parent=store.manifest.root_of(rows[0]) if rows else hashing.ROOT_PARENT)
        if [b.tobytes() for b in meta["block_id"]] != expect or len(ids) != entry.n_tokens:
            raise StoreCorruptError(f"store {self.location}: state {sid}'s block ids do not match its tokens")
        st = State(sid, ids, self.read_chain(rows), self.model.config, entry.label, self.model.device)
        st.encoding_error = store.error_report(rows)
        return st

    def forget_states(self, state_ids) -> int:
        """Remove states from the store's list (their blocks stay until gc, and are kept while another
        state or a document uses them). Unknown ids are skipped. Returns how many were removed."""
        ids = [self.resolve(s) for s in state_ids if isinstance(s, str) and s in self.require_store().manifest.states]
        if not ids:
            return 0

        def build(s):
            return Change(removed_states=tuple(x for x in ids if x in s.manifest.states))
        self.require_store().commit(build)
        return len(ids)

    def states(self) -> list[StateInfo]:
        store = self.require_store()
        store.refresh()
        return [StateInfo(k, v.n_tokens, v.label, v.created) for k, v in
                sorted(store.manifest.states.items(), key=lambda kv: kv[1].created)]


    def verify(self, recompute: bool = False, progress=None) -> list[tuple[int, str]]:
        """E1 (and with recompute=True, E2) over every committed block. Returns [(row, reason)]."""
        store = self.require_store()
        store.refresh()
        checked = store.verify_all(None if recompute else progress)
        if not recompute:
            return checked
        rows = store.manifest.committed_rows()
        meta = store.block_meta(rows)
        children: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            children.setdefault(int(meta["parent"][i]), []).append(row)
        at = {row: i for i, row in enumerate(rows)}
        bad = list(checked)
        e1_bad = {row for row, _ in checked}
        cache = kvops.make_cache(None, self.model.config)
        stack = [(r, 0) for r in reversed(children.get(-1, []))]   # (row, tokens before it)
        while stack:
            row, before = stack.pop()
            if before:
                kvops.truncate(cache, before)
            else:
                cache = kvops.make_cache(None, self.model.config)
            k = int(meta["n_tokens"][at[row]])
            name = meta["block_id"][at[row]].tobytes().hex()
            toks = [int(t) for t in meta["tokens"][at[row]][:k]]
            pos = meta["positions"][at[row]][:k]
            if list(pos) != list(range(before, before + k)):
                bad.append((row, f"block {name}: positions are not {before}..{before + k - 1}"))
                continue
            # a block is always computed right after its parent chain, as one forward (or forwards of
            # the store's prefill_tokens)
            _, fresh, _ = next(kvops.prefill_blocks(self.model, toks, store.manifest.block_tokens, cache, before,
                                                        store.manifest.chunk_tokens))
            try:
                stored = self.read_chain([row])
            except StoreError:            # reported by E1 above; descendants continue from the recomputed KV
                stored = None
            # a compact store holds the recomputed words encoded (decoding widens exactly: equal
            # decoded words are equal stored words)
            expect = fresh if not store.encoding.lossy else kvops.from_storage(
                store.encoding.roundtrip(kvops.to_storage(fresh)), self.kv_dtype)
            if stored is not None and row not in e1_bad and not torch.equal(to_host(expect), stored):
                bad.append((row, f"block {name} (row {row}): recomputed KV differs from the stored bytes"))
                kvops.truncate(cache, before)
                kvops.extend(cache, to_model(stored, self.model))   # descendants: against the stored truth
            if progress is not None:
                progress.update(1)
            stack.extend((c, before + k) for c in reversed(children.get(row, [])))
        return bad
