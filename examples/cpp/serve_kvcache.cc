// Serving an exported kvcache artifact from C++, with tvm-ffi's C API alone (no Python, no TVM
// compiler): what a serving engine does with `tvm-attention build --layout kvcache ...`.
//
//   g++ -O2 -std=c++17 serve_kvcache.cc -I$FFI/include -L$FFI/lib -ltvm_ffi -ldl \
//       -Wl,-rpath,$FFI/lib -o serve_kvcache                 # FFI: the tvm_ffi package folder
//   ./serve_kvcache ARTIFACT_DIR BATCH HEADS KV_HEADS MAX_LEN HEAD_DIM
//
// The artifact was built for float32, seq_q 1 (a decode step), causal, the default scale. Steps:
// 1. load TVM's runtime from the artifact (libtvm_runtime.so, RTLD_GLOBAL) and the library;
// 2. fill the library's three runtime slots, as TVM's own module loader does;
// 3. call __tvm_ffi_attention_spec_hash() (the spec the library was built from), then
//    __tvm_ffi_attention(q, k_cache, v_cache, cache_seqlens, o) on 64-byte aligned DLTensors, and
//    check o against a plain C++ reference;
// 4. call it again with a cache_seqlens entry past max_len: the library refuses it before any
//    K/V read, and the error (kind and message) comes back through TVMFFIErrorMoveFromRaised.
// Prints "spec_hash N", "max_abs_err E" and "error KIND: MESSAGE"; exits non-zero on a failure.
#include <dlfcn.h>
#include <tvm/ffi/c_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Tensor {  // a 64-byte aligned buffer and the DLTensor describing it
  std::vector<int64_t> shape;
  void* data = nullptr;
  DLTensor dl{};
  Tensor(std::vector<int64_t> s, DLDataType dtype) : shape(std::move(s)) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    size_t bytes = ((n * dtype.bits / 8) + 63) / 64 * 64;
    data = std::aligned_alloc(64, bytes ? bytes : 64);
    dl.data = data;
    dl.device = DLDevice{kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(shape.size());
    dl.dtype = dtype;
    dl.shape = shape.data();
    dl.strides = nullptr;  // compact
    dl.byte_offset = 0;
  }
  ~Tensor() { std::free(data); }
  float* f32() { return static_cast<float*>(data); }
  int32_t* i32() { return static_cast<int32_t*>(data); }
};

TVMFFIAny tensor_arg(Tensor& t) {
  TVMFFIAny a{};
  a.type_index = kTVMFFIDLTensorPtr;
  a.v_ptr = &t.dl;
  return a;
}

// The raised error as "kind: message" (and releases it).
std::string take_error() {
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) return "(no error object)";
  TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  std::string text = std::string(cell->kind.data, cell->kind.size) + ": " +
                     std::string(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s ARTIFACT_DIR BATCH HEADS KV_HEADS MAX_LEN HEAD_DIM\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t B = std::atoll(argv[2]), H = std::atoll(argv[3]), KH = std::atoll(argv[4]);
  const int64_t L = std::atoll(argv[5]), D = std::atoll(argv[6]);

  // Step 1. TVM's runtime first, globally: the library resolves nothing from it by name, but the
  // runtime registers its functions with tvm-ffi and provides the three below.
  void* rt = dlopen((dir + "/libtvm_runtime.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  void* lib = rt ? dlopen((dir + "/attention.so").c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  // Step 2. The library calls the runtime through data slots its loader must fill.
  for (const char* name : {"TVMBackendParallelLaunch", "TVMBackendAllocWorkspace", "TVMBackendFreeWorkspace"}) {
    void** slot = static_cast<void**>(dlsym(lib, (std::string("__") + name).c_str()));
    if (slot != nullptr && *slot == nullptr) *slot = dlsym(rt, name);
  }
  auto attention = reinterpret_cast<TVMFFISafeCallType>(dlsym(lib, "__tvm_ffi_attention"));
  auto spec_hash = reinterpret_cast<TVMFFISafeCallType>(dlsym(lib, "__tvm_ffi_attention_spec_hash"));
  if (attention == nullptr || spec_hash == nullptr) {
    std::fprintf(stderr, "the library lacks __tvm_ffi_attention or its spec hash\n");
    return 1;
  }

  // Step 3. Its spec, then one decode step.
  TVMFFIAny ret{};
  ret.type_index = kTVMFFINone;
  if (spec_hash(nullptr, nullptr, 0, &ret) != 0) {
    std::fprintf(stderr, "spec hash: %s\n", take_error().c_str());
    return 1;
  }
  std::printf("spec_hash %lld\n", static_cast<long long>(ret.v_int64));

  const DLDataType f32{kDLFloat, 32, 1}, i32{kDLInt, 32, 1};
  Tensor q({B, H, 1, D}, f32), k({B, KH, L, D}, f32), v({B, KH, L, D}, f32), lens({B}, i32), o({B, H, 1, D}, f32);
  uint32_t seed = 12345;
  auto rnd = [&seed]() { seed = seed * 1664525u + 1013904223u; return (seed >> 8) / 16777216.0f - 0.5f; };
  for (int64_t i = 0; i < B * H * D; ++i) q.f32()[i] = rnd();
  for (int64_t i = 0; i < B * KH * L * D; ++i) k.f32()[i] = rnd(), v.f32()[i] = rnd();
  for (int64_t b = 0; b < B; ++b) lens.i32()[b] = static_cast<int32_t>((b * 37 + 5) % (L + 1));
  TVMFFIAny args[5] = {tensor_arg(q), tensor_arg(k), tensor_arg(v), tensor_arg(lens), tensor_arg(o)};
  ret.type_index = kTVMFFINone;
  if (attention(nullptr, args, 5, &ret) != 0) {
    std::fprintf(stderr, "attention: %s\n", take_error().c_str());
    return 1;
  }
  // The reference: a new token sees keys [0, cache_seqlens[b]); none seen gives zeros.
  double max_err = 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kh = h / (H / KH), n = lens.i32()[b];
      const float* qr = q.f32() + (b * H + h) * D;
      std::vector<double> p(n);
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float* kr = k.f32() + ((b * KH + kh) * L + j) * D;
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += static_cast<double>(qr[d]) * kr[d];
        p[j] = s * scale;
        mx = std::fmax(mx, p[j]);
      }
      for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - mx));
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += p[j] * v.f32()[((b * KH + kh) * L + j) * D + d];
        const double want = n ? acc / sum : 0.0;
        max_err = std::fmax(max_err, std::fabs(want - o.f32()[(b * H + h) * D + d]));
      }
    }
  }
  std::printf("max_abs_err %.3e\n", max_err);

  // Step 4. A cache_seqlens entry past the cache: refused by the library itself, by name.
  lens.i32()[B - 1] = static_cast<int32_t>(L + 1);
  ret.type_index = kTVMFFINone;
  if (attention(nullptr, args, 5, &ret) == 0) {
    std::fprintf(stderr, "a cache_seqlens entry past max_len was not refused\n");
    return 1;
  }
  std::printf("error %s\n", take_error().c_str());
  return max_err < 1e-4 ? 0 : 1;
}
