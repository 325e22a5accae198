// fakegpu: a second device type (PrivateUse1, renamed "fakegpu" from Python) whose memory is
// host memory, plus "fakeccl", a c10d backend bound to that device that runs gloo underneath.
//
// Every op on a fakegpu tensor goes through ONE boxed fallback: it checks the device rules a
// CUDA kernel would enforce, replaces each fakegpu tensor by a zero-copy CPU alias over the same
// memory, runs the CPU kernel, and maps the results back (views stay views of the original
// storage, in-place/out= ops return the original argument, fresh results become fakegpu tensors
// owning the CPU result's memory). See fakegpu/__init__.py for the Python side.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace fakegpu {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
constexpr DeviceType kFake = DeviceType::PrivateUse1;

// ------------------------------------------------------------------------------- devices
static DeviceIndex device_count_impl() {
  static const DeviceIndex n = [] {
    const char* env = std::getenv("FAKEGPU_DEVICE_COUNT");
    long v = env ? std::strtol(env, nullptr, 10) : 8;
    if (v < 1) v = 1;
    if (v > 64) v = 64;
    return static_cast<DeviceIndex>(v);
  }();
  return n;
}

static thread_local DeviceIndex tl_device = 0;

static void check_index(DeviceIndex idx) {
  TORCH_CHECK(idx >= 0 && idx < device_count_impl(), "fakegpu: invalid device ordinal ", int(idx),
              " (FAKEGPU_DEVICE_COUNT=", int(device_count_impl()), ")");
}

static DeviceIndex current_device() { return tl_device; }
static void set_device(DeviceIndex idx) {
  if (idx < 0) return;
  check_index(idx);
  tl_device = idx;
}

// ------------------------------------------------------------------------------- allocator
// Device memory is counted as CUDA's caching allocator reports it (torch.cuda.memory_allocated,
// max_memory_allocated): the bytes of every live storage of a device, fakegpu's own allocations
// and the CPU kernels' results it took over alike, and their peak since the last reset.
static std::mutex g_memory_mutex;
static int64_t g_allocated[64] = {};
static int64_t g_peak[64] = {};

static void count_bytes(DeviceIndex dev, int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  g_allocated[dev] += bytes;
  if (g_allocated[dev] > g_peak[dev]) g_peak[dev] = g_allocated[dev];
}

// What a counted device storage's DataPtr owns: its own host memory (`raw`), or a CPU storage
// whose memory it took over (`keep`).
struct Counted {
  c10::Storage keep;
  void* raw;
  int64_t bytes;
  DeviceIndex dev;
};

static void delete_counted(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  count_bytes(c->dev, -c->bytes);
  if (c->raw) c10::free_cpu(c->raw);
  delete c;
}

struct FakeAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    DeviceIndex dev = current_device();
    count_bytes(dev, static_cast<int64_t>(n));
    return {p, new Counted{c10::Storage(), p, static_cast<int64_t>(n), dev}, &delete_counted, Device(kFake, dev)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // no raw_allocate: the context is not the data
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
};
static FakeAllocator g_alloc;
REGISTER_ALLOCATOR(kFake, &g_alloc);

// ------------------------------------------------------------------------------- guard
struct FakeEvent {
  std::chrono::steady_clock::time_point t;
};

struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = kFake;
  DeviceType type() const override { return kFake; }
  Device exchangeDevice(Device d) const override {
    Device old(kFake, tl_device);
    if (d.index() >= 0) set_device(d.index());
    return old;
  }
  Device getDevice() const override { return Device(kFake, tl_device); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kFake, "fakegpu guard got device ", d);
    set_device(d.index());
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count_impl()) tl_device = d.index();
  }
  static Device norm(Device d) { return d.index() < 0 ? Device(kFake, tl_device) : d; }
  c10::Stream getStream(Device d) const override { return c10::Stream(c10::Stream::DEFAULT, norm(d)); }
  c10::Stream getDefaultStream(Device d) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(Device d, bool = false) const override { return getStream(d); }
  c10::Stream getNewStream(Device d, int = 0) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const override { return getStream(s.device()); }
  DeviceIndex deviceCount() const noexcept override { return device_count_impl(); }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<FakeEvent*>(event);
  }
  void record(void** event, const c10::Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (*event == nullptr) *event = new FakeEvent();
    static_cast<FakeEvent*>(*event)->t = std::chrono::steady_clock::now();
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* e1, void* e2, const DeviceIndex) const override {
    TORCH_CHECK(e1 && e2, "fakegpu: both events must be recorded before elapsed_time");
    auto a = static_cast<FakeEvent*>(e1)->t, b = static_cast<FakeEvent*>(e2)->t;
    return std::chrono::duration<double, std::milli>(b - a).count();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);

// ------------------------------------------------------------------------------- generators
// A fakegpu generator is a device-tagged shell around a CPU generator (its "twin"); the fallback
// hands the twin to the CPU kernel. The default generator of every fakegpu device wraps the CPU
// default generator, so torch.manual_seed seeds both and fakegpu runs draw the same numbers as CPU.
struct FakeGenerator final : c10::GeneratorImpl {
  at::Generator cpu;
  FakeGenerator(DeviceIndex idx, at::Generator twin)
      : c10::GeneratorImpl(Device(kFake, idx), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu(std::move(twin)) {}
  void set_current_seed(uint64_t seed) override { cpu.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { cpu.set_offset(offset); }
  uint64_t get_offset() const override { return cpu.get_offset(); }
  uint64_t current_seed() const override { return cpu.current_seed(); }
  uint64_t seed() override { return cpu.seed(); }
  void set_state(const c10::TensorImpl& s) override { cpu.unsafeGetGeneratorImpl()->set_state(s); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return cpu.unsafeGetGeneratorImpl()->get_state();
  }
  FakeGenerator* clone_impl() const override { return new FakeGenerator(device().index(), cpu.clone()); }
};

static const at::Generator& default_generator(DeviceIndex idx) {
  static std::vector<at::Generator> gens = [] {
    std::vector<at::Generator> v;
    for (DeviceIndex i = 0; i < device_count_impl(); ++i)
      v.push_back(at::make_generator<FakeGenerator>(i, at::detail::getDefaultCPUGenerator()));
    return v;
  }();
  if (idx < 0) idx = current_device();
  check_index(idx);
  return gens[idx];
}

static at::Generator new_generator(DeviceIndex idx) {
  if (idx < 0) idx = current_device();
  check_index(idx);
  return at::make_generator<FakeGenerator>(idx, at::detail::createCPUGenerator());
}

// ------------------------------------------------------------------------------- hooks
struct FakeHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return device_count_impl(); }
  void setCurrentDevice(DeviceIndex d) const override { set_device(d); }
  DeviceIndex getCurrentDevice() const override { return current_device(); }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    auto old = current_device();
    set_device(d);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  const at::Generator& getDefaultGenerator(DeviceIndex idx) const override { return default_generator(idx); }
  at::Generator getNewGenerator(DeviceIndex idx) const override { return new_generator(idx); }
  Device getDeviceFromPtr(void*) const override { return Device(kFake, current_device()); }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), newsize);
  }
};
static bool hooks_registered [[maybe_unused]] = [] {
  at::RegisterPrivateUse1HooksInterface(new FakeHooks());
  return true;
}();

// ------------------------------------------------------------------------------- aliasing
static void delete_storage_ctx(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

static void* raw_data(const c10::Storage& st) {
  return const_cast<void*>(st.unsafeGetStorageImpl()->data_ptr().get());
}

// A DataPtr on `dev` over the memory of `st` that keeps `st` alive; on fakegpu the bytes become
// device memory (counted until the last storage using them goes).
static c10::DataPtr alias_data_ptr(const c10::Storage& st, Device dev) {
  if (dev.type() == kFake) {
    auto bytes = static_cast<int64_t>(st.nbytes());
    count_bytes(dev.index(), bytes);
    return c10::DataPtr(raw_data(st), new Counted{st, nullptr, bytes, dev.index()}, &delete_counted, dev);
  }
  return c10::DataPtr(raw_data(st), new c10::Storage(st), &delete_storage_ctx, dev);
}

// A storage on `dev` over the memory of `st` (any device) that keeps `st` alive.
static c10::Storage alias_storage(const c10::Storage& st, Device dev, c10::Allocator* alloc) {
  c10::DataPtr dp = alias_data_ptr(st, dev);
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), st.nbytes(), std::move(dp), alloc, /*resizable=*/true));
}

static at::Tensor make_on_storage(const c10::Storage& st, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(st), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) t._set_conj(true);
  if (like.is_neg()) t._set_neg(true);
  return t;
}

// A fakegpu tensor over the memory of a CPU tensor (zero copy, keeps the CPU storage alive).
static at::Tensor wrap_cpu(const at::Tensor& cpu, DeviceIndex idx) {
  auto st = alias_storage(cpu.storage(), Device(kFake, idx), &g_alloc);
  return make_on_storage(st, c10::DispatchKey::PrivateUse1, cpu);
}

// A CPU tensor over the memory of a fakegpu tensor (zero copy).
static at::Tensor cpu_view(const at::Tensor& t) {
  auto st = alias_storage(t.storage(), Device(DeviceType::CPU), c10::GetCPUAllocator());
  return make_on_storage(st, c10::DispatchKey::CPU, t);
}

static bool is_fake(const at::Tensor& t) { return t.defined() && t.device().type() == kFake; }

// ------------------------------------------------------------------------------- fallback
static const std::unordered_set<std::string>& copy_like_ops() {
  static const std::unordered_set<std::string> ops = {
      "aten::copy_", "aten::copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::_to_copy",
      "aten::set_", "aten::index", "aten::_unsafe_index", "aten::index_put_", "aten::index_put",
      "aten::_index_put_impl_", "aten::_unsafe_index_put", "aten::lift", "aten::lift_fresh",
      "aten::lift_fresh_copy", "aten::record_stream", "aten::_foreach_copy_"};
  return ops;
}

struct FallbackState {
  DeviceIndex fake_idx = -1;      // device of the fakegpu tensors
  DeviceIndex other_fake = -1;    // a second fakegpu device, if any
  DeviceIndex device_arg = -1;    // index from a Device argument naming fakegpu
  bool has_fake = false;
  bool cpu_nonscalar = false;
  // original fakegpu storage -> CPU alias storage (views of one storage share one alias)
  std::vector<std::pair<c10::StorageImpl*, std::pair<c10::Storage, c10::Storage>>> storages;
  std::unordered_map<c10::TensorImpl*, at::Tensor> alias_to_orig;
  std::unordered_map<c10::TensorImpl*, at::Tensor> orig_to_alias;
  std::unordered_set<c10::StorageImpl*> cpu_storages;
  std::vector<c10::Storage> cpu_storage_refs;  // keeps cpu_storages' keys alive
  std::unordered_map<c10::StorageImpl*, c10::Storage> fresh;  // CPU result storage -> fakegpu storage

  void scan(const at::Tensor& t) {
    if (!t.defined()) return;
    auto dev = t.device();
    if (dev.type() == kFake) {
      has_fake = true;
      if (fake_idx < 0) fake_idx = dev.index();
      else if (dev.index() != fake_idx && other_fake < 0) other_fake = dev.index();
    } else if (dev.type() == DeviceType::CPU) {
      if (t.dim() > 0) cpu_nonscalar = true;
      if (t.has_storage() && cpu_storages.insert(t.storage().unsafeGetStorageImpl()).second)
        cpu_storage_refs.push_back(t.storage());
    }
  }
  void scan(const c10::IValue& v) {
    if (v.isTensor()) scan(v.toTensor());
    else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) scan(t);
    else if (v.isList()) for (const auto& e : v.toListRef()) { if (e.isTensor()) scan(e.toTensor()); }
    else if (v.isDevice() && v.toDevice().type() == kFake) device_arg = v.toDevice().index();
  }

  at::Tensor to_cpu(const at::Tensor& t) {
    if (!is_fake(t)) return t;
    auto found = orig_to_alias.find(t.unsafeGetTensorImpl());
    if (found != orig_to_alias.end()) return found->second;
    TORCH_CHECK(t.layout() == c10::kStrided && t.has_storage(),
                "fakegpu: only strided (dense) tensors are supported, got layout ", t.layout());
    auto* si = t.storage().unsafeGetStorageImpl();
    c10::Storage alias;
    for (auto& e : storages)
      if (e.first == si) alias = e.second.second;
    if (!alias) {
      alias = alias_storage(t.storage(), Device(DeviceType::CPU), c10::GetCPUAllocator());
      storages.push_back({si, {t.storage(), alias}});
    }
    auto a = make_on_storage(alias, c10::DispatchKey::CPU, t);
    orig_to_alias.emplace(t.unsafeGetTensorImpl(), a);
    alias_to_orig.emplace(a.unsafeGetTensorImpl(), t);
    return a;
  }

  c10::IValue to_cpu(const c10::IValue& v) {
    if (v.isTensor()) return to_cpu(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      auto in = v.toTensorList();
      out.reserve(in.size());
      for (const at::Tensor& t : in) out.push_back(to_cpu(t));
      return out;
    }
    if (v.isList()) {
      auto in = v.toList();
      bool any = false;
      for (const auto& e : v.toListRef()) any |= e.isTensor();
      if (!any) return v;
      c10::impl::GenericList out(in.elementType());
      out.reserve(in.size());
      for (const auto& e : v.toListRef()) out.push_back(e.isTensor() ? c10::IValue(to_cpu(e.toTensor())) : e);
      return out;
    }
    if (v.isDevice() && v.toDevice().type() == kFake) return c10::IValue(Device(DeviceType::CPU));
    if (v.isGenerator()) {
      const auto& g = v.toGenerator();
      if (g.defined() && g.device().type() == kFake)
        return c10::IValue(static_cast<FakeGenerator*>(g.unsafeGetGeneratorImpl())->cpu);
    }
    return v;
  }

  DeviceIndex result_index() const {
    if (fake_idx >= 0) return fake_idx;
    if (device_arg >= 0) return device_arg;
    return current_device();
  }

  const c10::Storage* orig_of_alias(c10::StorageImpl* alias) const {
    for (auto& e : storages)
      if (e.second.second.unsafeGetStorageImpl() == alias) return &e.second.first;
    return nullptr;
  }

  // After the CPU kernel: an alias storage that was reallocated (resize of an out= argument)
  // hands its new memory to the original fakegpu storage.
  void sync_storages() {
    for (auto& e : storages) {
      auto& orig = e.second.first;
      auto& alias = e.second.second;
      if (raw_data(alias) != raw_data(orig) || alias.nbytes() != orig.nbytes()) {
        auto* oi = orig.unsafeGetStorageImpl();
        if (raw_data(alias) != raw_data(orig)) {
          oi->set_data_ptr_noswap(alias_data_ptr(alias, Device(kFake, orig.device().index())));
        }
        oi->set_nbytes(alias.nbytes());
      }
    }
  }

  c10::Storage fake_storage_for(const c10::Storage& cpu_st) {
    auto* si = cpu_st.unsafeGetStorageImpl();
    if (auto* o = orig_of_alias(si)) return *o;
    auto it = fresh.find(si);
    if (it != fresh.end()) return it->second;
    auto st = alias_storage(cpu_st, Device(kFake, result_index()), &g_alloc);
    fresh.emplace(si, st);
    return st;
  }

  // Metadata changes an op made to a mutable fakegpu argument's alias (sizes of a resized out=,
  // as_strided_, squeeze_, a swapped storage) go to the original tensor.
  void sync_mutable(const at::Tensor& orig, const at::Tensor& alias) {
    auto* oi = orig.unsafeGetTensorImpl();
    if (alias.storage().unsafeGetStorageImpl() != orig.storage().unsafeGetStorageImpl() &&
        orig_of_alias(alias.storage().unsafeGetStorageImpl()) == nullptr) {
      oi->set_storage_keep_dtype(fake_storage_for(alias.storage()));
    } else if (auto* o = orig_of_alias(alias.storage().unsafeGetStorageImpl())) {
      if (o->unsafeGetStorageImpl() != orig.storage().unsafeGetStorageImpl()) oi->set_storage_keep_dtype(*o);
    }
    if (alias.sizes() != orig.sizes() || alias.strides() != orig.strides() ||
        alias.storage_offset() != orig.storage_offset())
      oi->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
  }

  at::Tensor to_fake(const at::Tensor& r) {
    if (!r.defined() || r.device().type() != DeviceType::CPU) return r;
    auto it = alias_to_orig.find(r.unsafeGetTensorImpl());
    if (it != alias_to_orig.end()) return it->second;
    TORCH_CHECK(r.layout() == c10::kStrided && r.has_storage(),
                "fakegpu: the CPU kernel returned a non-strided (e.g. sparse) tensor, which fakegpu "
                "does not support (layout ", r.layout(), ")");
    auto* si = r.storage().unsafeGetStorageImpl();
    if (cpu_storages.count(si)) return r;  // a CPU argument (or a view of one), e.g. copy_'s dst
    if (r._is_zerotensor())
      return at::zeros(r.sizes(), r.options().device(Device(kFake, result_index())));
    return make_on_storage(fake_storage_for(r.storage()), c10::DispatchKey::PrivateUse1, r);
  }

  c10::IValue to_fake(const c10::IValue& v) {
    if (v.isTensor()) return to_fake(v.toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(to_fake(t));
      return out;
    }
    return v;
  }
};

static std::string dev_str(DeviceIndex idx) { return Device(kFake, idx).str(); }

static void fake_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t nargs = args.size();
  const size_t base = stack->size() - nargs;
  FallbackState s;
  for (size_t i = 0; i < nargs; ++i) s.scan((*stack)[base + i]);

  const bool copy_like = copy_like_ops().count(schema.name()) > 0;
  if (!copy_like && s.has_fake) {
    TORCH_CHECK(s.other_fake < 0,
                "Expected all tensors to be on the same device, but found at least two devices, ",
                dev_str(s.fake_idx), " and ", dev_str(s.other_fake), "! (in ", schema.operator_name(), ")");
    TORCH_CHECK(!s.cpu_nonscalar,
                "Expected all tensors to be on the same device, but found at least two devices, ",
                dev_str(s.fake_idx), " and cpu! (in ", schema.operator_name(), ")");
  }
  if (s.has_fake || s.device_arg >= 0) {
    for (size_t i = 0; i < nargs; ++i) {
      const auto& v = (*stack)[base + i];
      if (v.isGenerator()) {
        const auto& g = v.toGenerator();
        TORCH_CHECK(!g.defined() || g.device().type() == kFake, "Expected a '", c10::get_privateuse1_backend(),
                    "' device type for generator but found '", g.device().type(), "'");
      }
    }
  }

  std::vector<std::pair<at::Tensor, at::Tensor>> mutable_args;  // (orig, alias)
  for (size_t i = 0; i < nargs; ++i) {
    auto& slot = (*stack)[base + i];
    const auto* ai = args[i].alias_info();
    bool writes = ai != nullptr && ai->isWrite();
    at::Tensor orig = (writes && slot.isTensor()) ? slot.toTensor() : at::Tensor();
    slot = s.to_cpu(slot);
    if (is_fake(orig)) mutable_args.emplace_back(orig, slot.toTensor());
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  s.sync_storages();
  for (auto& [orig, alias] : mutable_args) s.sync_mutable(orig, alias);
  const size_t nret = schema.returns().size();
  const size_t rbase = stack->size() - nret;
  for (size_t i = 0; i < nret; ++i) (*stack)[rbase + i] = s.to_fake((*stack)[rbase + i]);
}

// ------------------------------------------------------------------------------- native kernels
static at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                      std::optional<c10::Layout> layout, std::optional<Device> device,
                                      std::optional<bool> pin_memory,
                                      std::optional<c10::MemoryFormat> memory_format) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.type() == kFake);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "fakegpu supports only strided (dense) tensors, got layout ", c10::layout_or_default(layout));
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only dense CPU tensors can be pinned");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_generic(size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

static at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                                std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                                std::optional<Device> device, std::optional<bool> pin_memory) {
  const auto dev = c10::device_or_default(device);
  TORCH_CHECK(dev.type() == kFake);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "fakegpu supports only strided (dense) tensors, got layout ", c10::layout_or_default(layout));
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only dense CPU tensors can be pinned");
  const c10::DeviceGuard guard(dev);
  return at::detail::empty_strided_generic(size, stride, &g_alloc,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

static at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                             std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

static const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                                 std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

static at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

static at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

static at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor src = is_fake(self) ? cpu_view(self) : self;
  at::Tensor d = is_fake(dst) ? cpu_view(dst) : dst;
  d.copy_(src, non_blocking);
  return dst;
}

static at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

static at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

static at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

static at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                                             c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kFake, "Attempted to set the storage of a tensor on device ",
              self.device(), " to a storage on different device ", source.device(),
              ". This is no longer allowed; the devices must match.");
  return at::cpu::set_(self, std::move(source), offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                       C10_AS_INTARRAYREF_SLOW(stride));
}

static at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, &g_alloc, /*resizable=*/true);
  return at::cpu::set_(self, st, 0, std::vector<int64_t>{0}, std::vector<int64_t>{});
}

static void record_stream(at::Tensor&, c10::Stream) {}

// CPU <-> fakegpu counts as "compatible" for shallow copies, as CPU <-> CUDA does in
// TensorImpl::has_compatible_shallow_copy_type (whose list of dense backends omits PrivateUse1):
// module.to("fakegpu") then keeps the Parameter objects (`param.data = ...`), so an optimizer built
// before the move still holds the module's parameters, exactly as with CUDA.
static bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    auto type = t.device().type();
    return t.layout() == c10::kStrided && (type == DeviceType::CPU || type == kFake);
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
         (dense(self) && dense(from));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("view", view);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("set_", set_empty);
  m.impl("record_stream", record_stream);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
}

// Ops that have a CPU kernel AND a CompositeExplicitAutograd kernel: the composite one (a math
// decomposition, e.g. math_native_layer_norm) would serve PrivateUse1 and differ from CPU in the
// last bits; route them to the CPU kernel like everything else.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"native_layer_norm", "native_group_norm", "addr", "addr.out", "all.dims",
                           "all.dims_out", "any.dims", "any.dims_out", "_stack", "_stack.out",
                           "linalg__powsum"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
}

// ------------------------------------------------------------------------------- fakeccl
// A c10d backend bound to fakegpu: it hands zero-copy CPU aliases of its fakegpu tensors to a
// gloo backend built over the same store/rank/size, so results land in place. A CPU tensor never
// reaches it through a ProcessGroup (no backend is registered for cpu); called directly it refuses.
class FakeCCLBackend final : public c10d::Backend {
 public:
  FakeCCLBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size)
      : c10d::Backend(rank, size), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return "fakeccl"; }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void startCoalescing() override { inner_->startCoalescing(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override { return inner_->endCoalescing(); }
  void setTimeout(std::chrono::milliseconds t) override { inner_->setTimeout(t); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    inner_->setGroupUid(uid);
  }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    auto c = cpu(t, "broadcast");
    return inner_->broadcast(c, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    auto c = cpu(t, "allreduce");
    return inner_->allreduce(c, o);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    auto c = cpu(t, "allreduce_coalesced");
    return inner_->allreduce_coalesced(c, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    auto c = cpu(t, "reduce");
    return inner_->reduce(c, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o) override {
    auto co = cpu(out, "allgather");
    auto ci = cpu(in, "allgather");
    return inner_->allgather(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& o) override {
    auto co = cpu1(out, "all_gather_into_tensor");
    auto ci = cpu1(in, "all_gather_into_tensor");
    return inner_->_allgather_base(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out,
                                                     std::vector<at::Tensor>& in,
                                                     const c10d::AllgatherOptions& o) override {
    auto co = cpu(out, "allgather_coalesced");
    auto ci = cpu(in, "allgather_coalesced");
    return inner_->allgather_coalesced(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::AllgatherOptions& o) override {
    auto co = cpu(out, "allgather_into_tensor_coalesced");
    auto ci = cpu(in, "allgather_into_tensor_coalesced");
    return inner_->allgather_into_tensor_coalesced(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                        const c10d::GatherOptions& o) override {
    auto co = cpu(out, "gather");
    auto ci = cpu(in, "gather");
    return inner_->gather(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                                         const c10d::ScatterOptions& o) override {
    auto co = cpu(out, "scatter");
    auto ci = cpu(in, "scatter");
    return inner_->scatter(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    auto co = cpu(out, "reduce_scatter");
    auto ci = cpu(in, "reduce_scatter");
    return inner_->reduce_scatter(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    auto co = cpu1(out, "reduce_scatter_tensor");
    auto ci = cpu1(in, "reduce_scatter_tensor");
    return inner_->_reduce_scatter_base(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                                                 std::vector<at::Tensor>& in,
                                                                 const c10d::ReduceScatterOptions& o) override {
    auto co = cpu(out, "reduce_scatter_tensor_coalesced");
    auto ci = cpu(in, "reduce_scatter_tensor_coalesced");
    return inner_->reduce_scatter_tensor_coalesced(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                               std::vector<int64_t>& is, const c10d::AllToAllOptions& o) override {
    auto co = cpu1(out, "all_to_all_single");
    auto ci = cpu1(in, "all_to_all_single");
    return inner_->alltoall_base(co, ci, os, is, o);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllToAllOptions& o) override {
    auto co = cpu(out, "all_to_all");
    auto ci = cpu(in, "all_to_all");
    return inner_->alltoall(co, ci, o);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    auto c = cpu(t, "send");
    return inner_->send(c, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    auto c = cpu(t, "recv");
    return inner_->recv(c, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    auto c = cpu(t, "recv");
    return inner_->recvAnysource(c, tag);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    c10d::BarrierOptions cpu_opts = o;
    cpu_opts.device = std::nullopt;
    return inner_->barrier(cpu_opts);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    inner_->monitoredBarrier(o, wait_all_ranks);
  }

  static bool allow_cpu;  // test hook: lets CPU tensors through (to prove a test can fail)

 private:
  static at::Tensor cpu1(const at::Tensor& t, const char* call) {
    if (!t.defined()) return t;
    if (t.device().type() != kFake) {
      TORCH_CHECK(allow_cpu, "fakeccl ", call, ": tensor on ", t.device(), ", but the fakeccl backend (like NCCL) ",
                  "only accepts tensors on ", c10::get_privateuse1_backend(), " devices");
      return t;
    }
    return cpu_view(t);
  }
  static std::vector<at::Tensor> cpu(const std::vector<at::Tensor>& ts, const char* call) {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) out.push_back(cpu1(t, call));
    return out;
  }
  static std::vector<std::vector<at::Tensor>> cpu(const std::vector<std::vector<at::Tensor>>& ts,
                                                  const char* call) {
    std::vector<std::vector<at::Tensor>> out;
    out.reserve(ts.size());
    for (const auto& v : ts) out.push_back(cpu(v, call));
    return out;
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
};
bool FakeCCLBackend::allow_cpu = false;

// Holder that drops the GIL while destroying a backend (as torch's own c10d bindings do).
template <typename T>
class NoGilPtr {
  c10::intrusive_ptr<T> impl_{};

 public:
  NoGilPtr() = default;
  NoGilPtr(const NoGilPtr&) = default;
  NoGilPtr(NoGilPtr&&) noexcept = default;
  NoGilPtr& operator=(const NoGilPtr&) = default;
  NoGilPtr& operator=(NoGilPtr&&) noexcept = default;
  /* implicit */ NoGilPtr(c10::intrusive_ptr<T> impl) : impl_(std::move(impl)) {}
  explicit NoGilPtr(T* impl) : impl_(c10::intrusive_ptr<T>::unsafe_steal_from_new(impl)) {}
  ~NoGilPtr() {
    if (impl_) {
      if (PyGILState_Check()) {
        pybind11::gil_scoped_release release;
        impl_.reset();
      } else {
        impl_.reset();
      }
    }
  }
  T& operator*() const noexcept { return *impl_; }
  T* operator->() const noexcept { return impl_.get(); }
  T* get() const noexcept { return impl_.get(); }
  void reset() noexcept { impl_.reset(); }
  operator c10::intrusive_ptr<T>() && { return std::move(impl_); }
};

}  // namespace fakegpu

PYBIND11_DECLARE_HOLDER_TYPE(T, fakegpu::NoGilPtr<T>, true)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using fakegpu::FakeCCLBackend;
  m.def("device_count", [] { return int(fakegpu::device_count_impl()); });
  m.def("current_device", [] { return int(fakegpu::current_device()); });
  m.def("set_device", [](int i) { fakegpu::set_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("default_generator", [](int i) { return fakegpu::default_generator(static_cast<c10::DeviceIndex>(i)); });
  m.def("_set_allow_cpu_in_backend", [](bool v) { FakeCCLBackend::allow_cpu = v; });
  m.def("memory_allocated", [](int i) {
    fakegpu::check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lock(fakegpu::g_memory_mutex);
    return fakegpu::g_allocated[i];
  });
  m.def("max_memory_allocated", [](int i) {
    fakegpu::check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lock(fakegpu::g_memory_mutex);
    return fakegpu::g_peak[i];
  });
  m.def("reset_peak_memory_stats", [](int i) {
    fakegpu::check_index(static_cast<c10::DeviceIndex>(i));
    std::lock_guard<std::mutex> lock(fakegpu::g_memory_mutex);
    fakegpu::g_peak[i] = fakegpu::g_allocated[i];
  });
  py::object backend_base = py::module_::import("torch._C._distributed_c10d").attr("Backend");
  py::class_<FakeCCLBackend, fakegpu::NoGilPtr<FakeCCLBackend>>(m, "FakeCCLBackend", backend_base)
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& inner, int rank, int size) {
             return c10::make_intrusive<FakeCCLBackend>(inner, rank, size);
           }),
           py::arg("inner"), py::arg("rank"), py::arg("size"))
      .def("_set_sequence_number_for_group", &FakeCCLBackend::setSequenceNumberForGroup,
           py::call_guard<py::gil_scoped_release>());
}
