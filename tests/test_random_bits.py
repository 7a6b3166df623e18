"""fp4jax.random_bits.bits == jax.random.bits bit for bit (the running recipe studies depend on it), and its
counters stay inside a loop over keys where jax.random.bits's are hoisted out."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax import random_bits

SHAPES = [(7,), (1,), (3, 5), (1, 1), (2, 3, 4), (16, 1, 33), (5, 1, 2, 3), (30, 70001), (64, 48, 80),
          (1, 4096, 16), (131, 1031, 3)]
DTYPES = [jnp.uint8, jnp.uint16, jnp.uint32]


def _keys():
  return [jax.random.key(3), jax.random.PRNGKey(5), jax.random.fold_in(jax.random.key(11), 7)]


def _assert_same(a, b):
  assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# By default every shape in uint32 and two shapes in the narrower dtypes; the other pairs under -m slow.
@pytest.mark.parametrize("shape, dtype", [
    (s, d) if d == jnp.uint32 or s in ((7,), (3, 5)) else pytest.param(s, d, marks=pytest.mark.slow)
    for s in SHAPES for d in DTYPES])
def test_equal_to_jax_random_bits_eager_and_jit(shape, dtype):
  for key in _keys():
    ref = jax.random.bits(key, shape, dtype)
    _assert_same(random_bits.bits(key, shape, dtype), ref)
    _assert_same(jax.jit(lambda k: random_bits.bits(k, shape, dtype))(key), ref)


def test_partitionable_threefry_is_what_is_compared():
  # The equality above is for JAX's default, jax_threefry_partitionable=True (the configuration in use).
  assert jax.config.jax_threefry_partitionable
  assert str(jax.random.key_impl(jax.random.key(0))) == "threefry2x32"


def test_equal_under_vmap_and_scan_over_keys():
  keys = jax.random.split(jax.random.key(1), 5)
  for dtype in DTYPES:
    ref = jax.vmap(lambda k: jax.random.bits(k, (33, 48), dtype))(keys)
    _assert_same(jax.jit(jax.vmap(lambda k: random_bits.bits(k, (33, 48), dtype)))(keys), ref)

    def step(f):
      return lambda c, k: (c, f(k, (17, 64), dtype))
    ref = jax.lax.scan(step(jax.random.bits), 0, keys)[1]
    _assert_same(jax.jit(lambda ks: jax.lax.scan(step(random_bits.bits), 0, ks)[1])(keys), ref)


def test_large_index_arithmetic_matches_python_ints():
  # Counters of arrays with more than 2**32 elements (the partitioned global shapes of a large model) need
  # the 64-bit index arithmetic; check it on random uint32 operands against exact Python integers.
  rng = np.random.default_rng(0)
  i = rng.integers(0, 2 ** 32, size=4096, dtype=np.uint64)
  i[:4] = [0, 1, 2 ** 32 - 1, 2 ** 31]
  for c in [1, 3, 2 ** 16 - 1, 2 ** 16, 12345, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 1, 22688 * 8192, 2 ** 40 + 12345]:
    keep = i * np.uint64(c) < np.uint64(2 ** 64 - 1) if c < 2 ** 32 else i < np.uint64(2 ** 64 // c)
    iv = i[keep]
    hi, lo = random_bits._mul_u32_by_const(jnp.asarray(iv, jnp.uint32), c)
    want = [int(v) * c for v in iv]
    got = [(int(h) << 32) | int(l_) for h, l_ in zip(np.asarray(hi), np.asarray(lo))]
    assert got == want, c
  a = rng.integers(0, 2 ** 63, size=1024, dtype=np.uint64)
  b = rng.integers(0, 2 ** 63, size=1024, dtype=np.uint64)
  split = lambda v: (jnp.asarray(v >> np.uint64(32), jnp.uint32), jnp.asarray(v & np.uint64(0xFFFFFFFF), jnp.uint32))
  hi, lo = random_bits._add_u64(split(a), split(b))
  got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
  np.testing.assert_array_equal(got, a + b)


def test_counters_are_the_row_major_index():
  shape = (3, 1, 70000, 5)
  hi, lo = random_bits._counters(shape, jnp.uint32(0))
  np.testing.assert_array_equal(np.asarray(lo), np.arange(np.prod(shape), dtype=np.uint32).reshape(shape))
  assert not np.asarray(hi).any()


def test_counters_of_an_array_beyond_two_to_the_32_elements():
  # The global (unpartitioned) shape of the 12B model's in_proj operand at 64 x 8192 tokens: 1.2e10 elements.
  # Only a corner is computed (XLA fuses the slice into the iotas), checked against exact Python integers.
  shape = (524288, 22688)
  corner = jax.jit(lambda z: [c[-3:, -5:] for c in random_bits._counters(shape, z)])(jnp.uint32(0))
  want = np.array([[r * shape[1] + c for c in range(shape[1] - 5, shape[1])]
                   for r in range(shape[0] - 3, shape[0])], dtype=np.uint64)
  np.testing.assert_array_equal(np.asarray(corner[0]), (want >> np.uint64(32)).astype(np.uint32))
  np.testing.assert_array_equal(np.asarray(corner[1]), (want & np.uint64(0xFFFFFFFF)).astype(np.uint32))


def test_falls_back_to_jax_random_bits_where_the_form_does_not_apply():
  key = jax.random.key(2)
  _assert_same(random_bits.bits(key, (), jnp.uint8), jax.random.bits(key, (), jnp.uint8))
  _assert_same(random_bits.bits(key, (0, 4), jnp.uint16), jax.random.bits(key, (0, 4), jnp.uint16))
  _assert_same(random_bits.bits(key, (3, 4), jnp.uint64 if jax.config.jax_enable_x64 else jnp.uint32),
               jax.random.bits(key, (3, 4), jnp.uint64 if jax.config.jax_enable_x64 else jnp.uint32))
  rbg = jax.random.key(2, impl="rbg")
  _assert_same(random_bits.bits(rbg, (8, 16), jnp.uint8), jax.random.bits(rbg, (8, 16), jnp.uint8))
  with jax.threefry_partitionable(False):
    _assert_same(random_bits.bits(key, (8, 16), jnp.uint8), jax.random.bits(key, (8, 16), jnp.uint8))


def test_counters_stay_in_the_loop():
  # A scan over keys drawing bits of one shape: jax.random.bits's counters are loop invariant, XLA hoists them
  # and keeps two uint32 arrays of the shape live through the loop; the tied counters are not hoisted.
  shape = (1024, 2048)
  counter_bytes = 2 * 4 * shape[0] * shape[1]

  def temp_bytes(draw):
    def body(c, k):
      return c + jnp.sum(draw(k, shape, jnp.uint8).astype(jnp.uint32)), None
    fn = jax.jit(lambda keys: jax.lax.scan(body, jnp.uint32(0), keys)[0])
    keys = jax.random.split(jax.random.key(0), 3)
    return fn.lower(keys).compile().memory_analysis().temp_size_in_bytes, fn(keys)

  temp_jax, total_jax = temp_bytes(jax.random.bits)
  temp_tied, total_tied = temp_bytes(random_bits.bits)
  assert int(total_jax) == int(total_tied)
  assert temp_tied <= temp_jax - counter_bytes, (temp_tied, temp_jax)


# ------------------------------------------------------------------------------------ the draw a kernel makes

def test_plain_op_threefry_equals_the_primitive():
  # threefry2x32 in uint32 adds/shifts/xors (what a Pallas kernel runs) == jax's threefry2x32 primitive,
  # on random words and on the carries' edge values.
  rng = np.random.default_rng(3)
  words = rng.integers(0, 2 ** 32, size=(4, 4096), dtype=np.uint64).astype(np.uint32)
  words[:, :3] = [[0, 2 ** 32 - 1, 2 ** 31]] * 4
  k1, k2, hi, lo = (jnp.asarray(w) for w in words)
  want = random_bits._THREEFRY2X32_P.bind(k1, k2, hi, lo)
  got = random_bits.threefry2x32(k1, k2, hi, lo)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


KEYED_CASES = [((7,), 0), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1), ((16, 1, 33), 0), ((5, 1, 2, 3), 2),
               ((131, 1031, 3), 1), ((1, 4096, 16), -1)]


@pytest.mark.parametrize("case", [pytest.param(i, marks=() if i in (2, 5, 6) else pytest.mark.slow)
                                  for i in range(len(KEYED_CASES))])
def test_keyed_bits_are_jax_random_bits(case):
  # KeyedBits.of(key, shape, axis): rows (..., 4) and cols (K, 2) whose hash (plain ops, as in a kernel) and
  # whose XLA draw (make) are moveaxis(jax.random.bits(key, shape), axis, -1). Eager (each jit of the
  # unrolled hash costs seconds of CPU compile); jit and vmap in the next test.
  shape, axis = KEYED_CASES[case]
  key = _keys()[case % 3]
  kb = random_bits.KeyedBits.of(key, shape, axis)
  r, c = kb.rows, kb.cols
  hashed = random_bits.hashed_bits(r[..., 0, None], r[..., 1, None], r[..., 2, None], r[..., 3, None],
                                   c[:, 0], c[:, 1])
  _assert_same(hashed, jnp.moveaxis(jax.random.bits(key, shape, jnp.uint32), axis, -1))
  dtype = DTYPES[case % 3]
  _assert_same(kb.make(dtype), jnp.moveaxis(jax.random.bits(key, shape, dtype), axis, -1))


def test_keyed_bits_under_vmap_over_keys_and_of_a_window():
  keys = jax.random.split(jax.random.key(1), 3)
  got = jax.jit(jax.vmap(lambda k: random_bits.KeyedBits.of(k, (33, 48), 0).make()))(keys)
  _assert_same(got, jax.vmap(lambda k: jax.random.bits(k, (33, 48), jnp.uint8).T)(keys))
  key = jax.random.key(4)
  window = random_bits.Window.of(key, (40, 96), (5, 17), (8, 32))
  _assert_same(window.keyed().make(), jax.random.bits(key, (40, 96), jnp.uint8)[5:13, 17:49])
  assert random_bits.KeyedBits.of(window, (8, 32), 0) is None     # another rectangle: the caller draws


def test_hashed_counters_carry_into_the_high_word():
  # row + col past 2**32 (arrays beyond 4 Gi elements): the 64-bit sum's carry reaches the hashed high word.
  rng = np.random.default_rng(5)
  row = rng.integers(0, 2 ** 63, size=512, dtype=np.uint64)
  col = rng.integers(0, 2 ** 40, size=512, dtype=np.uint64)
  row[:2] = [2 ** 32 - 1, 2 ** 33 - 5]
  col[:2] = [1, 7]
  split = lambda v: (jnp.asarray(v >> np.uint64(32), jnp.uint32), jnp.asarray(v & np.uint64(0xFFFFFFFF), jnp.uint32))
  k1, k2 = jnp.uint32(0x12345678), jnp.uint32(0x9ABCDEF0)
  got = random_bits.hashed_bits(k1, k2, *split(row), *split(col))
  b1, b2 = random_bits._THREEFRY2X32_P.bind(*(jnp.broadcast_to(k, (512,)) for k in (k1, k2)), *split(row + col))
  _assert_same(got, b1 ^ b2)


# ------------------------------------------------------------------------------------ the packed layout

# docs/NUMERICS.md's test vector: key jax.random.key(42) (words 0, 42), shape (2, 16) along the last axis.
PACKED_VECTOR = [[143, 4, 62, 109, 45, 23, 34, 16, 45, 179, 215, 3, 244, 131, 208, 173],
                 [234, 32, 251, 146, 19, 217, 56, 15, 70, 105, 213, 186, 145, 168, 75, 53]]


def _packed_oracle(key, shape, axis):
  """The packed layout from its definition, independently of random_bits: x with ``axis`` last, its groups of 8
  as an array (..., K/8), counter = row-major index (numpy), threefry2x32 (jax's primitive), and the 8 bytes of
  (w0, w1) as little-endian memory (numpy's view: w0's bytes low first, then w1's)."""
  moved = np.moveaxis(np.zeros(shape), axis, -1).shape
  grid = moved[:-1] + (moved[-1] // 8,)
  counter = np.arange(np.prod(grid), dtype=np.uint64)
  k1, k2 = (jnp.full(counter.shape, v, jnp.uint32) for v in np.asarray(jax.random.key_data(key)))
  w0, w1 = random_bits._THREEFRY2X32_P.bind(k1, k2, jnp.asarray(counter >> np.uint64(32), jnp.uint32),
                                            jnp.asarray(counter & np.uint64(0xFFFFFFFF), jnp.uint32))
  words = np.stack([np.asarray(w0), np.asarray(w1)], axis=-1).astype("<u4")
  return np.moveaxis(words.view(np.uint8).reshape(moved), -1, axis)


def test_packed_layout_test_vector():
  key = jax.random.key(42)
  got = random_bits.rounding_bits(key, (2, 16), layout="packed")
  assert got.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(got), np.array(PACKED_VECTOR, np.uint8))
  np.testing.assert_array_equal(np.asarray(got), _packed_oracle(key, (2, 16), -1))
  # really another stream: not the bytes of jax.random.bits, which remain the default
  assert (np.asarray(got) != np.asarray(jax.random.bits(key, (2, 16), jnp.uint8))).mean() > 0.9
  _assert_same(random_bits.rounding_bits(key, (2, 16)), jax.random.bits(key, (2, 16), jnp.uint8))


PACKED_CASES = [((16,), 0), ((3, 16), -1), ((48, 5), 0), ((2, 32, 3), 1), ((4, 24, 3), 1), ((1, 4096, 16), 1)]


@pytest.mark.parametrize("shape,axis", [c if i < 4 else pytest.param(*c, marks=pytest.mark.slow)   # a middle
                                        for i, c in enumerate(PACKED_CASES)])   # axis and a long row: slow
def test_packed_twin_kernel_hash_and_oracle_agree(shape, axis):
  # rounding_bits (XLA, jitted), KeyedBits.make (the primitive's XLA side) and the plain-op hash a kernel runs
  # (hashed_words + packed_bytes on rows and cols[::8]) against the definition (_packed_oracle).
  key = jax.random.fold_in(jax.random.key(7), len(shape))
  want = _packed_oracle(key, shape, axis)
  _assert_same(jax.jit(lambda k: random_bits.rounding_bits(k, shape, axis, "packed"))(key), jnp.asarray(want))
  kb = random_bits.KeyedBits.of(key, shape, axis, "packed")
  assert kb.layout == "packed" and kb.cols.shape == (shape[axis], 2)
  moved = jnp.asarray(np.moveaxis(want, axis, -1))
  _assert_same(kb.make(), moved)
  r, c = kb.rows, kb.cols[::8]
  words = random_bits.hashed_words(r[..., 0, None], r[..., 1, None], r[..., 2, None], r[..., 3, None],
                                   c[:, 0], c[:, 1])
  _assert_same(random_bits.packed_bytes(*words).astype(jnp.uint8), moved)
  assert [random_bits.group_byte(words, e)[..., 0].astype(jnp.uint8).tolist() for e in range(8)] == \
      [moved[..., e].tolist() for e in range(8)]


def test_packed_under_vmap_and_of_a_window():
  keys = jax.random.split(jax.random.key(1), 3)
  got = jax.jit(jax.vmap(lambda k: random_bits.KeyedBits.of(k, (40, 48), 0, "packed").make()))(keys)
  _assert_same(got, jnp.stack([jnp.asarray(_packed_oracle(k, (40, 48), 0)).T for k in keys]))
  # A window (fp4jax.grouped's piece of an expert's draw): the rectangle of the full packed draw; its column
  # start and width are multiples of 8.
  key = jax.random.key(4)
  full = random_bits.rounding_bits(key, (40, 96), layout="packed")
  window = random_bits.Window.of(key, (40, 96), (5, 16), (8, 32))
  _assert_same(random_bits.rounding_bits(window, (8, 32), layout="packed"), full[5:13, 16:48])
  _assert_same(window.keyed("packed").make(), full[5:13, 16:48])
  _assert_same(window.keyed().make(), jax.random.bits(key, (40, 96), jnp.uint8)[5:13, 16:48])


# Random123's known answers for philox4x32-10 (kat_vectors): (counter x0..x3, key k0 k1) -> four words.
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
              ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
              ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
               (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def test_philox4x32_gives_random123s_known_answers():
  u32 = lambda v: jnp.array([v], jnp.uint32)
  for x, k, want in PHILOX_KAT:
    got = jax.jit(random_bits.philox4x32)(*map(u32, k), *map(u32, x))
    assert [int(w[0]) for w in got] == list(want)


def _philox_oracle(key, shape, axis):
  """The philox layout by its definition (docs/NUMERICS.md), in numpy: group g (16 consecutive elements along
  ``axis``, numbered row-major) hashed at the counter (g mod 2^32, g >> 32, 0, 0) under the key's two words;
  element 16g + e takes byte e of the 128 bits, low word and low byte first."""
  moved = tuple(np.moveaxis(np.empty(shape), axis, -1).shape)
  g = np.arange(int(np.prod(moved)) // 16, dtype=np.uint64)
  k = np.asarray(jax.random.key_data(key))
  words = random_bits.philox4x32(*(jnp.full(g.shape, v, jnp.uint32) for v in k),
                                 jnp.asarray(g & np.uint64(0xFFFFFFFF), jnp.uint32),
                                 jnp.asarray(g >> np.uint64(32), jnp.uint32),
                                 jnp.zeros(g.shape, jnp.uint32), jnp.zeros(g.shape, jnp.uint32))
  b = np.stack([np.asarray(w) for w in words], axis=-1).astype("<u4").view(np.uint8)
  return np.moveaxis(b.reshape(moved), -1, axis)


PHILOX_VECTOR = [[11, 23, 45, 64, 31, 247, 119, 9, 219, 41, 158, 163, 89, 154, 227, 161],
                 [30, 223, 143, 21, 161, 23, 76, 139, 71, 87, 235, 43, 118, 253, 113, 37]]


def test_philox_layout_test_vector():   # docs/NUMERICS.md's vector: key jax.random.key(42), shape (2, 16)
  got = random_bits.rounding_bits(jax.random.key(42), (2, 16), layout="philox")
  np.testing.assert_array_equal(np.asarray(got), np.array(PHILOX_VECTOR, np.uint8))
  np.testing.assert_array_equal(np.asarray(got), _philox_oracle(jax.random.key(42), (2, 16), -1))


@pytest.mark.parametrize("shape,axis", [((16,), 0), ((3, 32), -1), ((48, 5), 0), ((2, 32, 3), 1)])
def test_philox_twin_kernel_hash_and_oracle_agree(shape, axis):
  # rounding_bits, KeyedBits.make and the plain-op hash a kernel runs (hashed_words + group_bytes on rows and
  # cols[::16]) against the definition
  key = jax.random.fold_in(jax.random.key(8), len(shape))
  want = _philox_oracle(key, shape, axis)
  _assert_same(jax.jit(lambda k: random_bits.rounding_bits(k, shape, axis, "philox"))(key), jnp.asarray(want))
  kb = random_bits.KeyedBits.of(key, shape, axis, "philox")
  moved = jnp.asarray(np.moveaxis(want, axis, -1))
  _assert_same(kb.make(), moved)
  r, c = kb.rows, kb.cols[::16]
  words = random_bits.hashed_words(r[..., 0, None], r[..., 1, None], r[..., 2, None], r[..., 3, None],
                                   c[:, 0], c[:, 1], layout="philox")
  _assert_same(random_bits.group_bytes(words).astype(jnp.uint8), moved)
  assert [random_bits.group_byte(words, e)[..., 0].astype(jnp.uint8).tolist() for e in range(16)] == \
      [moved[..., e].tolist() for e in range(16)]
  # a window's rectangle (fp4jax.grouped): column start and width multiples of 16
  if len(shape) == 2 and axis == -1:
    full = random_bits.rounding_bits(key, (8, 64), layout="philox")
    window = random_bits.Window.of(key, (8, 64), (2, 16), (3, 32))
    _assert_same(random_bits.rounding_bits(window, (3, 32), layout="philox"), full[2:5, 16:48])
    _assert_same(window.keyed("philox").make(), full[2:5, 16:48])


def test_packed_refuses_what_it_cannot_draw():
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="multiple of 8"):
    random_bits.rounding_bits(key, (4, 20), layout="packed")
  with pytest.raises(ValueError, match="multiple of 8"):
    random_bits.KeyedBits.of(key, (20, 16), 0, "packed")
  with pytest.raises(ValueError, match="multiple of 16"):
    random_bits.rounding_bits(key, (4, 24), layout="philox")
  with pytest.raises(ValueError, match="threefry2x32"):
    random_bits.rounding_bits(jax.random.key(0, impl="rbg"), (4, 16), layout="packed")
  with pytest.raises(ValueError, match="sr_bits='pack'"):
    random_bits.rounding_bits(key, (4, 16), layout="pack")
  assert random_bits.rounding_bits(key, (0, 16), layout="packed").shape == (0, 16)


def test_packed_hash_ops_are_fewer():
  # The integer work the cost model charges a hashing kernel (kernels._common.int_ops_suffix).
  n = 8192 * 8192
  assert random_bits.hash_ops("jax", n) == 126 * n
  assert random_bits.hash_ops("packed", n) == n // 8 * 124 + 3 * n
  assert random_bits.hash_ops("jax", n) / random_bits.hash_ops("packed", n) > 6.5
  assert random_bits.hash_ops("philox", n) == n // 16 * 97 + 2 * n
  assert random_bits.hash_ops("packed", n) / random_bits.hash_ops("philox", n) > 2.2
