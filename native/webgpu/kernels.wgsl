// colibri's WebGPU kernels: the weight products of the webgpu backend, on weights as the
// container stores them (docs/formats.md), never converted (backends/webgpu.py).
//
// A product y = x @ W^T runs one invocation per output row o (of the weight piece bound),
// LANES a workgroup: it reads its row once, a word at a time, for up to TILE activation
// rows at once, and writes those rows' outputs. No invocation waits for another (no
// barriers, no workgroup memory), so each output is computed by one fixed sequence of
// operations, whatever the batch, and a driver that runs compute on the CPU (Mesa's
// lavapipe) pays nothing to synchronise lanes.
//
// mm_f32 (the F32 kernel family): each weight as its code times its scale (as
// formats.quant.dequantize), accumulated in f32. Accurate, not bit-exact (as the CPU's F32
// family).
//
// mm_i8 (the I8 family): native/src/ref/ref.c defines the arithmetic and the CPU kernels
// of every ISA give its bits; so does this kernel. Per output, per scale group in
// increasing order: isum = the exact int32 dot of the weight codes and the row's int8
// codes over the group (`dot4`, four codes at a time), then
// acc = acc + (float)isum * (wscale[o, g] * xs), acc starting at 0.0 (Q2/Q3, whose weights
// are q * s + m: acc = acc + ((float)isum * (s * xs) + (float)xsum * (m * xs)), xsum the
// sum of the row's codes over the group, `group_share`). Every product that
// feeds an addition goes through `rounded`, which the compiler cannot see through, so no
// driver contracts it into a fused multiply-add. The host sends only weights whose scale
// groups are whole 32-input chunks, or one group a row.

struct Params {
    o: u32,          // output rows of this dispatch
    i: u32,          // inputs a row
    rows: u32,       // activation rows
    fmt: u32,        // FMT_* (the pipeline's FMT)
    gsz: u32,        // inputs a scale group (i when one a row)
    groups: u32,     // scale groups a row
    row_bytes: u32,  // bytes a weight row
    w_row0: u32,     // the first weight row of the piece this dispatch computes
    o_base: u32,     // y column of its first output row
    o_total: u32,    // y's row stride (floats)
    x_base: u32,     // x's first word
    ldx: u32,        // x's row stride (words)
    y_base: u32,     // y's first float
    xs_base: u32,    // xs's first float (I8)
    wg_x: u32,       // workgroups along x (more go along y)
    zero: u32,       // always 0; the compiler cannot know it (see `rounded`)
}

const FMT_F32: u32 = 0u;
const FMT_BF16: u32 = 1u;
const FMT_Q8: u32 = 2u;
const FMT_Q4: u32 = 3u;
const FMT_FP4: u32 = 4u;
const FMT_Q2: u32 = 5u;
const FMT_Q3: u32 = 6u;

const LANES: u32 = 64u;
// Specialised per pipeline (backends/webgpu_device.py): the weight format, and the
// activation rows an invocation computes at once (1 for a decode step, else 4).
override FMT: u32 = 3u;
override TILE: u32 = 4u;
const CHUNK: u32 = 32u;

@group(0) @binding(0) var<storage, read> w: array<u32>;   // weight rows, as stored
@group(0) @binding(1) var<storage, read> sc: array<u32>;  // f32 scale bits, e8m0 bytes, or f16 (s, m)
@group(0) @binding(2) var<storage, read> x: array<u32>;   // f32 bits (F32), int8 codes x4 (I8)
@group(0) @binding(3) var<storage, read> xs: array<f32>;  // I8: each row's scale
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

fn byte_at(b: u32) -> u32 {
    return (w[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

// The 32-bit word of weight bytes b..b+3, whatever b's alignment.
fn word_at(b: u32) -> u32 {
    let k = b >> 2u;
    let shift = (b & 3u) * 8u;
    if (shift == 0u) {
        return w[k];
    }
    return (w[k] >> shift) | (w[k + 1u] << (32u - shift));
}

// 2^(e - 128), exact (subnormal below e = 2); 255 is e8m0's NaN: as the C kernels.
fn fp4_scale(e: u32) -> f32 {
    var u: u32;
    if (e == 255u) {
        u = 0x7fc00000u;
    } else if (e >= 2u) {
        u = (e - 1u) << 23u;
    } else {
        u = 0x00200000u << e;
    }
    return bitcast<f32>(u);
}

// ---- Q2 / Q3, the low-bit affine formats (colibrid/formats/affine.py, docs/formats.md): a
// block of 16 (Q2) or 24 (Q3) bytes per group of 64 inputs, the last padded with code 0.
// Bytes 0..15, the low plane: bits 2k, 2k + 1 of byte j are the low two bits of the code of
// input 16k + j; Q3's bytes 16..23, the high plane: bit b of byte 16 + j is bit 2 of the
// code of input 8b + j. Each group's scale s and minimum m are one word of float16s (s in
// the low half), so a weight is f32(q) * s + m. Rows are whole blocks (multiples of 8
// bytes), so every block starts on a word.

const AFFINE_GROUP: u32 = 64u;

fn affine() -> bool {
    return FMT == FMT_Q2 || FMT == FMT_Q3;
}

fn block_bytes() -> u32 {
    return select(16u, 24u, FMT == FMT_Q3);
}

// float16 bits as an f32, exactly (subnormals, infinities and NaN too), by integer steps:
// no driver's half conversion (which may flush subnormals) decides a bit.
fn half_value(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 31u;
    let m = h & 1023u;
    if (e == 0u) {  // zero or subnormal: m * 2^-24, exact
        return bitcast<f32>(sign | bitcast<u32>(f32(m) * 5.9604644775390625e-8));
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// Row o's scale and minimum of group g.
fn affine_sm(o: u32, g: u32) -> vec2<f32> {
    let pair = sc[o * p.groups + g];
    return vec2<f32>(half_value(pair & 0xffffu), half_value(pair >> 16u));
}

// The codes of inputs 16k + 4t .. 16k + 4t + 3 of the group whose block starts at word bw,
// one a byte (t = 0..3): a shift and a mask of low-plane word t, and for Q3 bit
// 2k + t / 2 of high-plane word t % 2 moved up to bit 2.
fn affine_word(bw: u32, k: u32, t: u32) -> u32 {
    var codes = (w[bw + t] >> (2u * k)) & 0x03030303u;
    if (FMT == FMT_Q3) {
        codes |= ((w[bw + 4u + (t & 1u)] >> (2u * k + (t >> 1u))) & 0x01010101u) << 2u;
    }
    return codes;
}

// The code (0..7) of input i of the Q2/Q3 row starting at byte r.
fn affine_code(r: u32, i: u32) -> i32 {
    let b = r + (i / AFFINE_GROUP) * block_bytes();
    let k = i % AFFINE_GROUP;
    var code = (byte_at(b + (k & 15u)) >> (2u * (k >> 4u))) & 3u;
    if (FMT == FMT_Q3) {
        code |= ((byte_at(b + 16u + (k & 7u)) >> (k >> 3u)) & 1u) << 2u;
    }
    return i32(code);
}

// Row o's scale of group g (Q8 and per-row Q4: g = 0).
fn scale_of(o: u32, g: u32) -> f32 {
    let k = o * p.groups + g;
    if (FMT == FMT_FP4) {
        return fp4_scale((sc[k >> 2u] >> ((k & 3u) * 8u)) & 0xffu);
    }
    return bitcast<f32>(sc[k]);
}

fn group_of(i: u32) -> u32 {
    return select(i / p.gsz, 0u, p.groups == 1u);
}

// The integer a nibble stands for: Q4's q = nibble - 8, FP4's doubled e2m1 value
// (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: (2 + m) << (e - 1) from e >= 1, computed
// rather than looked up, as a table indexed at run time costs a copy an invocation).
fn nibble_code(nibble: u32) -> i32 {
    if (FMT == FMT_FP4) {
        let c = nibble & 7u;
        let magnitude = select((2u + (c & 1u)) << ((c >> 1u) - 1u), c, c < 2u);
        return select(i32(magnitude), -i32(magnitude), nibble >= 8u);
    }
    return i32(nibble) - 8;
}

// The integer code of input i of the row starting at byte r (Q8, Q4, FP4).
fn code_at(r: u32, i: u32) -> i32 {
    if (FMT == FMT_Q8) {
        return extractBits(i32(byte_at(r + i)), 0u, 8u);
    }
    return nibble_code((byte_at(r + (i >> 1u)) >> ((i & 1u) * 4u)) & 15u);
}

// Weight (o, i) as a float: the code times its scale, as formats.quant.dequantize.
fn weight_at(o: u32, r: u32, i: u32) -> f32 {
    if (FMT == FMT_F32) {
        return bitcast<f32>(word_at(r + 4u * i));
    }
    if (FMT == FMT_BF16) {
        let b = r + 2u * i;
        return bitcast<f32>(((w[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu) << 16u);
    }
    if (affine()) {
        let sm = affine_sm(o, i / AFFINE_GROUP);
        return f32(affine_code(r, i)) * sm.x + sm.y;
    }
    return f32(code_at(r, i)) * scale_of(o, group_of(i));
}

// Activation rows s0..s0+3 at input i (F32 family), rows past the last read as 0.
fn x4(s0: u32, i: u32) -> vec4<f32> {
    if (TILE == 1u) {
        return vec4<f32>(bitcast<f32>(x[p.x_base + s0 * p.ldx + i]), 0.0, 0.0, 0.0);
    }
    var v = vec4<f32>(0.0);
    for (var t = 0u; t < TILE; t++) {
        if (s0 + t < p.rows) {
            v[t] = bitcast<f32>(x[p.x_base + (s0 + t) * p.ldx + i]);
        }
    }
    return v;
}

fn row_of(wid: vec3<u32>, lane: u32) -> u32 {
    return (wid.x + wid.y * p.wg_x) * LANES + lane;
}

fn store4(o: u32, s0: u32, v: vec4<f32>) {
    for (var t = 0u; t < TILE; t++) {
        if (s0 + t < p.rows) {
            y[p.y_base + (s0 + t) * p.o_total + p.o_base + o] = v[t];
        }
    }
}

// Whether a row may be read a word at a time, eight inputs a step, one scale a step.
fn by_words() -> bool {
    let whole = p.i % 8u == 0u && p.row_bytes % 4u == 0u;
    return whole && (p.groups == 1u || p.gsz % 8u == 0u);
}

// Inputs i0..i0+7 of the row at word rw times activation rows s0..s0+3 (the row read a
// word at a time: `by_words`).
fn eight(ow: u32, rw: u32, i0: u32, s0: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    if (affine()) {  // inputs 16k + 4t.. of group g: codes words t0 and t0 + 1
        let g = i0 / AFFINE_GROUP;
        let sm = affine_sm(ow, g);
        let bw = rw + g * block_bytes() / 4u;
        let k = (i0 % AFFINE_GROUP) / 16u;
        let t0 = (i0 % 16u) / 4u;
        for (var h = 0u; h < 2u; h++) {
            let codes = affine_word(bw, k, t0 + h);
            for (var n = 0u; n < 4u; n++) {
                let wv = f32((codes >> (8u * n)) & 0xffu) * sm.x + sm.y;
                acc += wv * x4(s0, i0 + 4u * h + n);
            }
        }
        return acc;
    }
    let s = scale_of(ow, group_of(i0));
    if (FMT == FMT_Q8) {
        let a = w[rw + i0 / 4u];
        let b = w[rw + i0 / 4u + 1u];
        for (var n = 0u; n < 4u; n++) {
            acc += (f32(extractBits(i32(a), 8u * n, 8u)) * s) * x4(s0, i0 + n);
            acc += (f32(extractBits(i32(b), 8u * n, 8u)) * s) * x4(s0, i0 + 4u + n);
        }
    } else {
        let word = w[rw + i0 / 8u];
        for (var n = 0u; n < 8u; n++) {
            acc += (f32(nibble_code((word >> (4u * n)) & 15u)) * s) * x4(s0, i0 + n);
        }
    }
    return acc;
}

@compute @workgroup_size(64)
fn mm_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let o = row_of(wid, lane);
    if (o >= p.o) {
        return;
    }
    let ow = p.w_row0 + o;
    let r = ow * p.row_bytes;
    let rw = r >> 2u;
    let fast = by_words() && FMT >= FMT_Q8;
    for (var s0 = 0u; s0 < p.rows; s0 += TILE) {
        var acc = vec4<f32>(0.0);
        if (fast) {
            for (var i0 = 0u; i0 < p.i; i0 += 8u) {
                acc += eight(ow, rw, i0, s0);
            }
        } else {
            for (var i = 0u; i < p.i; i++) {
                acc += weight_at(ow, r, i) * x4(s0, i);
            }
        }
        store4(o, s0, acc);
    }
}

// v with its bits passed through an integer OR the compiler cannot see is zero: the
// rounded value of whatever computed v, never fused into what uses it.
fn rounded(v: vec4<f32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(v) | vec4<u32>(p.zero));
}

// Four signed codes as the bytes of one word (dot4's operand).
fn pack4(a: i32, b: i32, c: i32, d: i32) -> u32 {
    return (u32(a) & 0xffu) | ((u32(b) & 0xffu) << 8u) | ((u32(c) & 0xffu) << 16u)
        | ((u32(d) & 0xffu) << 24u);
}

// Activation row s's codes word k of chunk c (rows past the last: row 0, never stored).
fn xq(s: u32, c: u32, k: u32) -> u32 {
    let row = select(0u, s, s < p.rows);
    return x[p.x_base + row * p.ldx + c * 8u + k];
}

// The exact integer dots of chunk c (inputs 32c..32c+31) of the row at byte r with
// activation rows s0..s0+3's codes there.
fn chunk_dot(r: u32, c: u32, s0: u32) -> vec4<i32> {
    let i0 = c * CHUNK;
    var acc = vec4<i32>(0);
    if (affine()) {  // whole blocks, ragged ends too (codes and x's codes are 0 past i)
        // chunk c is half c % 2 of group c / 2: x's word k is plane 2 (c % 2) + k / 4, word k % 4
        let bw = (r + (c / 2u) * block_bytes()) / 4u;
        for (var k = 0u; k < 8u; k++) {
            let packed = affine_word(bw, 2u * (c & 1u) + k / 4u, k & 3u);
            for (var t = 0u; t < TILE; t++) {
                acc[t] += dot4(packed, xq(s0 + t, c, k));
            }
        }
        return acc;
    }
    if (i0 + CHUNK > p.i) {  // a row's ragged end, code by code (the codes are zero past i)
        for (var i = i0; i < p.i; i++) {
            let k = i - i0;
            let code = code_at(r, i);
            for (var t = 0u; t < TILE; t++) {
                acc[t] += code * extractBits(i32(xq(s0 + t, c, k >> 2u)), (k & 3u) * 8u, 8u);
            }
        }
        return acc;
    }
    for (var k = 0u; k < 8u; k++) {  // word k of the chunk's codes: inputs 4k..4k+3
        var packed: u32;
        if (FMT == FMT_Q8) {
            packed = word_at(r + i0 + 4u * k);
        } else {  // nibbles 4(k%2)..: the low nibble of each byte first
            let word = word_at(r + i0 / 2u + 4u * (k / 2u)) >> (16u * (k & 1u));
            packed = pack4(
                nibble_code(word & 15u),
                nibble_code((word >> 4u) & 15u),
                nibble_code((word >> 8u) & 15u),
                nibble_code((word >> 12u) & 15u),
            );
        }
        for (var t = 0u; t < TILE; t++) {
            acc[t] += dot4(packed, xq(s0 + t, c, k));
        }
    }
    return acc;
}

// The sums of activation rows s0..s0+3's codes over chunk c (Q2/Q3's minimum multiplies
// them): exact integers.
fn chunk_xsum(c: u32, s0: u32) -> vec4<i32> {
    var acc = vec4<i32>(0);
    for (var k = 0u; k < 8u; k++) {
        for (var t = 0u; t < TILE; t++) {
            acc[t] += dot4(0x01010101u, xq(s0 + t, c, k));
        }
    }
    return acc;
}

// Group g's share of the outputs (isum, xsum: its integer sums; xsv: the rows' scales):
// (float)isum * (s * xs) for Q8/Q4/FP4, and for Q2/Q3
// (float)isum * (s * xs) + (float)xsum * (m * xs), every step rounded alone.
fn group_share(ow: u32, g: u32, isum: vec4<i32>, xsum: vec4<i32>, xsv: vec4<f32>) -> vec4<f32> {
    if (affine()) {
        let sm = affine_sm(ow, g);
        let scaled = rounded(vec4<f32>(isum) * rounded(sm.x * xsv));
        let offset = rounded(vec4<f32>(xsum) * rounded(sm.y * xsv));
        return rounded(scaled + offset);
    }
    return rounded(vec4<f32>(isum) * rounded(scale_of(ow, g) * xsv));
}

@compute @workgroup_size(64)
fn mm_i8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let o = row_of(wid, lane);
    if (o >= p.o) {
        return;
    }
    let ow = p.w_row0 + o;
    let r = ow * p.row_bytes;
    let chunks = (p.i + CHUNK - 1u) / CHUNK;
    let per_group = select(p.gsz / CHUNK, chunks, p.groups == 1u);
    for (var s0 = 0u; s0 < p.rows; s0 += TILE) {
        var row_scales = vec4<f32>(0.0);
        for (var t = 0u; t < TILE; t++) {
            row_scales[t] = xs[p.xs_base + select(0u, s0 + t, s0 + t < p.rows)];
        }
        var acc = vec4<f32>(0.0);
        for (var g = 0u; g < p.groups; g++) {
            var isum = vec4<i32>(0);
            var xsum = vec4<i32>(0);
            let first = g * per_group;
            for (var c = first; c < min(first + per_group, chunks); c++) {
                isum += chunk_dot(r, c, s0);
                if (affine()) {
                    xsum += chunk_xsum(c, s0);
                }
            }
            acc = acc + group_share(ow, g, isum, xsum, row_scales);
        }
        store4(o, s0, acc);
    }
}

// `fn dot4(a: u32, b: u32) -> i32`, the exact dot of two words' four signed bytes, is
// appended by the host: WGSL's dot4I8Packed where the adapter's compiler takes it, else
// DOT4_PORTABLE (backends/webgpu_device.py).

// ---- The same products with a workgroup per output row (a GPU's way) --------------------
// On a GPU, an invocation per row leaves most of the chip idle at decode (a 2048-row
// matrix is 32 workgroups) and its reads scattered; these run one workgroup per row, its
// LANES invocations reading neighbouring words of the row, and put the row's result
// together in a fixed order: mm_f32_rows adds the lanes' partial sums pairwise in
// workgroup memory; mm_i8_rows adds each chunk's integer dot into its scale group's
// workgroup atomic (integers: exact in any order; Q2/Q3's sums of x's codes in a second
// run of atomics after the groups', so those formats hold at most GMAX / 2 groups a row),
// then one lane per activation row takes the float steps in group order, as mm_i8 does. The host picks these for GPU adapters
// (backends/webgpu_device.py `cooperative`); the tests run both on every adapter.

const GMAX: u32 = 512u;  // scale groups a row mm_i8_rows holds (the host sends no more)

var<workgroup> partial: array<vec4<f32>, 64>;     // LANES
var<workgroup> isums: array<atomic<i32>, 2048>;   // GMAX * 4 activation rows

@compute @workgroup_size(64)
fn mm_f32_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let o = wid.x + wid.y * p.wg_x;
    if (o >= p.o) {
        return;
    }
    let ow = p.w_row0 + o;
    let r = ow * p.row_bytes;
    let rw = r >> 2u;
    let fast = by_words() && FMT >= FMT_Q8;
    for (var s0 = 0u; s0 < p.rows; s0 += TILE) {
        var acc = vec4<f32>(0.0);
        if (fast) {
            for (var i0 = lane * 8u; i0 < p.i; i0 += LANES * 8u) {
                acc += eight(ow, rw, i0, s0);
            }
        } else {
            for (var i = lane; i < p.i; i += LANES) {
                acc += weight_at(ow, r, i) * x4(s0, i);
            }
        }
        partial[lane] = acc;
        workgroupBarrier();
        for (var step = LANES / 2u; step > 0u; step >>= 1u) {
            if (lane < step) {
                partial[lane] += partial[lane + step];
            }
            workgroupBarrier();
        }
        if (lane == 0u) {
            store4(o, s0, partial[0]);
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn mm_i8_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let o = wid.x + wid.y * p.wg_x;
    if (o >= p.o) {
        return;
    }
    let ow = p.w_row0 + o;
    let r = ow * p.row_bytes;
    let chunks = (p.i + CHUNK - 1u) / CHUNK;
    let per_group = select(p.gsz / CHUNK, chunks, p.groups == 1u);
    for (var s0 = 0u; s0 < p.rows; s0 += TILE) {
        let slots = select(1u, 2u, affine()) * p.groups * 4u;
        for (var k = lane; k < slots; k += LANES) {
            atomicStore(&isums[k], 0);
        }
        workgroupBarrier();
        for (var c = lane; c < chunks; c += LANES) {
            let g = c / per_group;
            let dots = chunk_dot(r, c, s0);
            for (var t = 0u; t < TILE; t++) {
                atomicAdd(&isums[g * 4u + t], dots[t]);
            }
            if (affine()) {
                let sums = chunk_xsum(c, s0);
                for (var t = 0u; t < TILE; t++) {
                    atomicAdd(&isums[(p.groups + g) * 4u + t], sums[t]);
                }
            }
        }
        workgroupBarrier();
        if (lane < TILE && s0 + lane < p.rows) {
            let xsv = vec4<f32>(xs[p.xs_base + s0 + lane]);
            var acc = vec4<f32>(0.0);
            for (var g = 0u; g < p.groups; g++) {
                let isum = vec4<i32>(atomicLoad(&isums[g * 4u + lane]));
                var xsum = vec4<i32>(0);
                if (affine()) {
                    xsum = vec4<i32>(atomicLoad(&isums[(p.groups + g) * 4u + lane]));
                }
                acc = acc + group_share(ow, g, isum, xsum, xsv);
            }
            y[p.y_base + (s0 + lane) * p.o_total + p.o_base + o] = acc.x;
        }
        workgroupBarrier();
    }
}
