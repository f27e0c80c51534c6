// Elementwise kernels of the webgpu backend (backends/webgpu.py), one invocation a value.

struct Span {
    n: u32,     // values
    a_base: u32,
    b_base: u32,
    out_base: u32,
    wg_x: u32,  // workgroups along x (more go along y)
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> span: Span;

fn index(wid: vec3<u32>, lane: u32) -> u32 {
    return (wid.x + wid.y * span.wg_x) * 256u + lane;
}

// out = silu(a) * b: an expert's hidden values from its gate and up products (F32 family).
@compute @workgroup_size(256)
fn swiglu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = index(wid, lane);
    if (t >= span.n) {
        return;
    }
    let v = a[span.a_base + t];
    out[span.out_base + t] = v / (1.0 + exp(-v)) * b[span.b_base + t];
}

// The device's read bandwidth probe: invocation t sums values t, t + stride, ... of a
// (stride = every invocation of the dispatch), one float written each, so nothing is
// optimised away; b is not read.
@compute @workgroup_size(256)
fn read_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32,
            @builtin(num_workgroups) groups: vec3<u32>) {
    let t = index(wid, lane);
    let stride = groups.x * groups.y * 256u;
    var sum = 0.0;
    for (var k = t; k < span.n; k += stride) {
        sum += a[k];
    }
    out[t] = sum;
}
