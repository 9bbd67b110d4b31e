r"""Fast pack / unpack / vote kernels: vectorised word tricks, no per-element Python.

The layouts of :mod:`lioncub.wire.packing` (element ``8j+k`` is bit ``k`` of byte ``j``;
``w``-bit lanes, lane ``k`` at bits ``k·w``), computed with few passes over memory:

* **pack** — the byte values (0/1 signs or lane values) are read as machine words
  and folded into one byte per word. For sign bits, with the 8 bytes ``b_k`` of an
  int64 word ``x``::

      (x · 0x0102040810204080) >> 56 = Σ_k b_k·2^k

  because ``b_k`` lands at bit ``8k + 7(7-k) + 7 = 56 + k`` and no two partial
  products share a bit (so nothing carries). Lanes use ``x | x >> (8-w) | …`` on an
  int16 (``w = 4``) or int32 (``w = 2``) word: two or three passes instead of
  torch's ``(lanes << shifts).sum(dim)`` over an int64 temporary.
* **unpack** — one ``index_select`` into a 256-entry table whose entries are the
  8 (or 4, 2) unpacked bytes of a packed byte, read as one int64 (int32, int16).
* **vote on packed bits** (:func:`vote_bits`, :func:`majority_bits`) — the P rows of
  packed signs are never unpacked: a bit-sliced counter (plane ``j`` holds bit ``j`` of
  64 counts per int64 word; adding a row is a ripple of AND/XOR over ⌈log2(P+1)⌉
  planes) and one bit-sliced comparison with ⌊P/2⌋ give the "2k > P" and "2k = P"
  masks, still packed. :func:`unpack_pm1` / :func:`spread_votes` then write ``u``
  once: int8 bytes by the 256-word table gather, floats by one 256-row embedding
  lookup. torch's uint8 comparisons run element by element on CPU (~1 ns each);
  word ops and 8-byte gathers run near memory speed.
* **vote on lane sums** (:func:`vote_lanes`) — lanes are spread to one byte each by
  shift/OR on int16/int32 words and compared with ``+(127-t)`` per byte (lane sums
  are < 16, so no carry crosses a byte).

Everything here is a pure function of tensors and works on any device (the fused
per-parameter passes are :mod:`lioncub.fused`'s, not these). Tested element for element
against plain reference loops (``tests/test_kernels.py``).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "sign_bits",
    "pack_bytes",
    "unpack_bytes",
    "unpack_pm1",
    "vote_bits",
    "majority_bits",
    "majority_bits_held",
    "spread_votes",
    "vote_lanes",
]

_MUL_BITS = 0x0102040810204080  # gathers the low bit of each byte into the top byte
_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}  # word holding 8/w lane bytes


def _padded_bytes(n: int, bits: int, device) -> Tensor:
    """A uint8 buffer of ``n`` bytes rounded up to whole words (one word per packed
    byte: ``8 // bits`` bytes), the tail zeroed."""
    per_byte = 8 // bits
    buf = torch.empty(-(-n // per_byte) * per_byte, dtype=torch.uint8, device=device)
    buf[n:].zero_()
    return buf


def sign_bits(c: Tensor, step: int, length: int | None = None) -> Tensor:
    """``c > 0`` (zeros → +1 on even steps, −1 on odd) as 0/1 bytes in a word-padded
    uint8 buffer ready for :func:`pack_bytes` (``[:c.numel()]`` are the signs).

    ``length`` pads the buffer with zeros to at least that many bytes (``onebit``'s
    P equal chunks)."""
    n = c.numel()
    buf = _padded_bytes(max(n, length or 0), 1, c.device)
    buf[n:].zero_()
    out = buf[:n].view(torch.bool)
    if step % 2 == 0:
        torch.ge(c.reshape(-1), 0, out=out)
    else:
        torch.gt(c.reshape(-1), 0, out=out)
    return buf


def pack_bytes(values: Tensor, n: int, bits: int) -> Tensor:
    """Pack the first ``n`` byte values of ``values`` into ``bits``-wide lanes.

    ``values``: flat uint8 (or bool), each < 2**bits. When it is at least one word
    per output byte long (a buffer from :func:`sign_bits`) it is packed in place and
    its bytes past ``n`` must be 0; otherwise it is copied into a zero-padded buffer.
    Returns ``ceil(n·bits/8)`` bytes: element ``j`` in lane ``j % (8/bits)`` of byte ``j // (8/bits)``.
    """
    values = values.reshape(-1).view(torch.uint8)
    per_byte = 8 // bits
    nbytes = -(-n // per_byte)
    if bits == 8:
        return values[:n].clone()
    need = nbytes * per_byte  # one word of per_byte bytes per output byte
    if values.numel() >= need and values.storage_offset() % per_byte == 0:
        src = values[:need]
    else:
        src = _padded_bytes(n, bits, values.device)
        src[:n] = values[:n]
    word = src.view(_WORD[bits])  # (nbytes,): lane k of output byte j in byte k of word j
    if bits == 1:
        folded = word * _MUL_BITS  # wraps mod 2**64: the sum lands in the top byte
        folded >>= 56
    elif bits == 2:
        folded = word | (word >> 6)
        folded |= folded >> 12
    else:
        folded = word | (word >> 4)
    return folded.to(torch.uint8)  # the low byte (truncating cast)


def _where(t: Tensor):
    """The tables' cache key for ``t``: its device, and for a fake tensor (``FakeTensorMode``) its mode too, so
    that a table made under one fake mode (a memory estimate, a trace) never meets real tensors or another."""
    from torch._subclasses.fake_tensor import is_fake

    return (str(t.device), id(t.fake_mode)) if is_fake(t) else str(t.device)


@functools.lru_cache(maxsize=None)
def _table(bits: int, kind: str, where) -> Tensor:
    """256-entry unpack table: entry b holds the 8/bits unpacked bytes of byte b, as one word."""
    per_byte = 8 // bits
    device = where if isinstance(where, str) else where[0]
    b = torch.arange(256, dtype=torch.int64, device=device).unsqueeze(1)  # made there: no host copy
    shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=device)
    lanes = (b >> shifts) & ((1 << bits) - 1)  # (256, per_byte)
    if kind == "pm1":  # sign bits as ±1 (int8)
        lanes = lanes * 2 - 1
    t = lanes.to(torch.int8).view(torch.uint8).contiguous()
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[per_byte]
    return t.view(word).reshape(256)


def unpack_bytes(packed: Tensor, n: int, bits: int) -> Tensor:
    """The first ``n`` lane values of ``packed`` (flat uint8) as uint8, one per element."""
    if bits == 8:
        return packed.reshape(-1)[:n]
    idx = packed.reshape(-1).to(torch.int32)
    words = torch.index_select(_table(bits, "lanes", _where(packed)), 0, idx)
    return words.view(torch.uint8)[:n]


def unpack_pm1(packed: Tensor, n: int, dtype: torch.dtype = torch.int8, out: Tensor | None = None) -> Tensor:
    """Sign bits as ±1 of ``dtype`` (bit 1 → +1, bit 0 → −1): the voted 1-bit result.

    int8 by word arithmetic; floating dtypes by one lookup of 8 values per packed
    byte (no int8 temporary, no second conversion pass). ``out``: a flat tensor of
    ``n`` elements of ``dtype`` to write into (no allocation of the result)."""
    flat = packed.reshape(-1)
    if dtype == torch.int8:
        idx = flat.to(torch.int32)
        u = torch.index_select(_table(1, "pm1", _where(packed)), 0, idx).view(torch.int8)[:n]
        return u if out is None else out.copy_(u)
    table = _float_table(dtype, _where(packed))
    if out is None:
        return torch.nn.functional.embedding(flat.to(torch.int64), table).reshape(-1)[:n]
    whole = n // 8  # bytes whose 8 elements all fit in out
    idx = flat[:-(-n // 8)].to(torch.int64)
    torch.index_select(table, 0, idx[:whole], out=out[:whole * 8].view(whole, 8))
    if n % 8:
        # a one-row index_select: indexing with a 0-dim device tensor would read it on the host
        out[whole * 8:] = table.index_select(0, idx[whole:whole + 1])[0, :n % 8]
    return out


# ----------------------------------------------------------------------------- word (SWAR) votes
_ONES = 0x0101010101010101  # 1 in every byte of an int64


@functools.lru_cache(maxsize=None)
def _float_table(dtype: torch.dtype, where) -> Tensor:
    """(256, 8): row b holds the 8 sign bits of byte b as ±1 in ``dtype``."""
    device = where if isinstance(where, str) else where[0]
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    return (bits * 2 - 1).to(dtype)


def _as_words(packed: Tensor) -> Tensor:
    """Rows of uint8 as int64 words (a zero-padded copy when a row is not whole words)."""
    rows = packed.reshape(packed.shape[0], -1) if packed.dim() > 1 else packed.reshape(1, -1)
    m = rows.shape[1]
    if m % 8 or rows.stride(0) != m or rows.storage_offset() % 8:
        padded = torch.zeros(rows.shape[0], -(-m // 8) * 8, dtype=torch.uint8, device=rows.device)
        padded[:, :m] = rows
        rows = padded
    return rows.view(torch.int64)


def _spread(packed: Tensor) -> Tensor:
    """Each bit of a flat uint8 tensor as one 0/1 byte: int64 words, 8 per packed byte
    (one gather from a 256-word table: faster on CPU than the multiply/carry chain)."""
    idx = packed.reshape(-1).to(torch.int32)
    return torch.index_select(_table(1, "lanes", _where(packed)), 0, idx)


def vote_bits(packed: Tensor, world: int) -> tuple[Tensor, Tensor]:
    """Per element of the P rows of packed sign bits: masks "2k > P" and "2k = P".

    Both are packed like the rows (int64 words; ``.view(torch.uint8)`` gives bytes,
    zero-padded past the rows' length). Needs P ≤ 255."""
    if world > 255:
        raise ValueError(f"vote_bits needs at most 255 rows, got {world}")
    rows = _as_words(packed)
    planes: list[Tensor] = []  # planes[j]: bit j of the running counts
    for r in range(rows.shape[0]):
        carry = rows[r].clone()
        for j in range(len(planes)):
            nxt = planes[j] & carry
            planes[j] ^= carry
            carry = nxt
        if len(planes) < (r + 1).bit_length():
            planes.append(carry)  # otherwise the carry is provably zero
    t = world // 2  # 2k > P  ⟺  k > ⌊P/2⌋
    gt = torch.zeros_like(rows[0])
    eq = torch.full_like(rows[0], -1)
    if t >= 1 << len(planes):
        return gt, gt.clone()
    for j in reversed(range(len(planes))):  # compare from the top bit down
        if (t >> j) & 1:
            eq &= planes[j]
        else:
            gt |= eq & planes[j]
            eq &= ~planes[j]
    if world % 2:
        eq.zero_()  # odd P: k = ⌊P/2⌋ means 2k < P, not a tie
    return gt, eq


def majority_bits(packed: Tensor, world: int, step: int, count=None) -> Tensor:
    """The 1-bit vote of the P rows, packed: 2k > P wins, ties follow the step parity.

    Returns uint8 of the rows' byte length: bit set where 2k > P, or 2k = P on an even step.
    ``count``: the function that makes :func:`vote_bits`'s masks (default: it; the votes pass
    :func:`lioncub.fused.vote_bits`, one GPU kernel for CUDA rows)."""
    gt, eq = (count or vote_bits)(packed, world)
    if step % 2 == 0:
        gt |= eq
    m = packed.reshape(packed.shape[0], -1).shape[1] if packed.dim() > 1 else packed.numel()
    return gt.view(torch.uint8)[:m]


def majority_bits_held(packed: Tensor, world: int, held: Tensor, count=None) -> Tensor:
    """The 1-bit vote of the P rows, packed: 2k > P wins, a tie repeats ``held`` (the
    element's last vote, packed uint8 of the rows' byte length), which is then updated to
    this vote. Returns uint8 of the rows' byte length. ``count``: as :func:`majority_bits`."""
    gt, eq = (count or vote_bits)(packed, world)
    m = held.numel()
    last = torch.zeros_like(gt).view(torch.uint8)
    last[:m] = held
    gt |= eq & last.view(gt.dtype)
    out = gt.view(torch.uint8)[:m]
    held.copy_(out)
    return out


def _as_dtype(u8: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    """int8 votes as ``dtype``, written into ``out`` when given."""
    if out is not None:
        return out.copy_(u8)
    return u8 if dtype == torch.int8 else u8.to(dtype)


def spread_votes(pos: Tensor, neg: Tensor, n: int, dtype: torch.dtype = torch.int8,
                 out: Tensor | None = None) -> Tensor:
    """``u = pos − neg`` per element from packed masks (never both set) as ``dtype``
    (into ``out``, ``n`` elements, when given)."""
    u = _spread(neg.view(torch.uint8))
    u *= 0xFF  # 0/1 → 0x00/0xFF (−1)
    u |= _spread(pos.view(torch.uint8))
    return _as_dtype(u.view(torch.int8)[:n], dtype, out)


def vote_lanes(packed: Tensor, n: int, bits: int, above: int, below: int,
               dtype: torch.dtype = torch.int8, out: Tensor | None = None) -> Tensor:
    """``u = (k > above) − (k < below)`` for the ``bits``-wide lane values ``k`` of ``packed``
    (into ``out``, ``n`` elements of ``dtype``, when given).

    Word arithmetic for 2- and 4-bit lanes (lane values ≤ 15); 8-bit lanes compare bytes."""
    if bits == 8:
        k = packed.reshape(-1)[:n]
        return _as_dtype((k > above).view(torch.int8) - (k < below).view(torch.int8), dtype, out)
    flat = packed.reshape(-1)
    x = torch.zeros(-(-flat.numel() // (bits * 2)) * bits * 2, dtype=_WORD[bits], device=packed.device)
    x[:flat.numel()] = flat  # one word per packed byte (8/bits bytes), whole int64 words in all
    if bits == 4:
        y = x << 4
        y |= x
        y &= 0x0F0F  # byte 0: low lane, byte 1: high lane
    else:
        y = x | (x << 6)
        y |= x << 12
        y |= x << 18
        y &= 0x03030303  # lane k (bits 2k..2k+1) → byte k
    words = _as_words(y.view(torch.uint8))[0]
    pos = words + (127 - above) * _ONES  # bit 7 of a byte set iff k > above (k ≤ 15: no carry)
    pos >>= 7
    pos &= _ONES
    ge = (128 - below) * _ONES
    words += ge - (1 << 64) if ge >= 1 << 63 else ge  # bit 7 set iff k ≥ below
    words >>= 7
    words &= _ONES
    words ^= _ONES  # k < below
    words *= 0xFF
    words |= pos
    return _as_dtype(words.view(torch.int8)[:n], dtype, out)
