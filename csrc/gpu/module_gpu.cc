// The GPU room's face in jaxdecl._host._dispatch: the CUDA handlers'
// registrations, what device kernels call back (copies, stream waits, DLPack),
// and the tests' entries: the fake runtime and a call site driven on host
// memory through the exact staging path of the CUDA handlers.

#include <Python.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../registry.h"
#include "cuda_runtime.h"
#include "dlpack.h"
#include "gpu.h"
#include "staging.h"

namespace py = pybind11;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatchSplitCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatchEagerCuda);

namespace jaxdecl::gpu {
namespace {

const CudaRuntime& RuntimeOrThrow() {
  std::string error;
  const CudaRuntime* rt = Runtime(&error);
  if (rt == nullptr) throw std::runtime_error(error);
  return *rt;
}

void Check(const CudaRuntime& rt, int code, const std::string& what) {
  if (code != 0) throw std::runtime_error(what + " failed: " + ErrorText(rt, code));
}

void* AsPointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Buffers described from Python as (address, shape, type code), and a frame
// of them: what the tests hand the staging path as "device" buffers.
struct Described {
  std::vector<std::vector<int64_t>> dims;
  Frame frame;

  Described(const std::vector<std::tuple<uintptr_t, std::vector<int64_t>, int>>& inputs,
            const std::vector<std::tuple<uintptr_t, std::vector<int64_t>, int>>& outputs) {
    frame.Reset(inputs.size(), outputs.size());
    dims.reserve(inputs.size() + outputs.size());
    auto fill = [&](const auto& item, XLA_FFI_Buffer* out) {
      dims.push_back(std::get<1>(item));
      *out = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                            static_cast<XLA_FFI_DataType>(std::get<2>(item)),
                            AsPointer(std::get<0>(item)), static_cast<int64_t>(dims.back().size()),
                            dims.back().data()};
    };
    for (size_t i = 0; i < inputs.size(); ++i) fill(inputs[i], &frame.arg(i));
    for (size_t j = 0; j < outputs.size(); ++j) fill(outputs[j], &frame.ret(j));
  }
};

using Descriptions = std::vector<std::tuple<uintptr_t, std::vector<int64_t>, int>>;

// A call site whose "device" buffers are host memory: the tests' entry to the
// CUDA handlers' staging path (run with the fake runtime).
struct StagedSite {
  Staging staging;
  ViewCache views;

  ~StagedSite() { views.Clear(); }  // (pybind11 destroys it with the GIL held)

  py::object Run(int64_t slot, const Descriptions& inputs, const Descriptions& outputs,
                 int ordinal, uintptr_t stream, int drop) {
    KernelPtr kernel = FindBySlot(slot);
    if (kernel == nullptr) throw py::value_error("no kernel in slot " + std::to_string(slot));
    Described described(inputs, outputs);
    std::string error;
    {
      py::gil_scoped_release release;  // as XLA calls the handler
      error = RunOnDevice(*kernel,
                          DeviceCall{described.frame.Args(), described.frame.Rets(), false,
                                     &views, drop, AsPointer(stream), ordinal},
                          staging);
    }
    return error.empty() ? py::object(py::none()) : py::object(py::str(error));
  }

  // (ordinal, addresses, capacities) of each pool kept.
  std::vector<std::tuple<int, std::vector<uintptr_t>, std::vector<size_t>>> Pools() {
    std::lock_guard<std::mutex> lock(staging.mutex);
    std::vector<std::tuple<int, std::vector<uintptr_t>, std::vector<size_t>>> found;
    for (const auto& pool : staging.pools) {
      std::vector<uintptr_t> addresses;
      for (void* buffer : pool->buffers) addresses.push_back(reinterpret_cast<uintptr_t>(buffer));
      found.emplace_back(pool->ordinal, addresses, pool->capacities);
    }
    return found;
  }
};

}  // namespace

void DefineModule(py::module_& m) {
  m.def("gpu_registrations", []() {
    // Execute stages only: no state on CUDA (see handlers.cc).
    py::dict targets;
    targets["jaxdecl_dispatch"] = py::capsule(reinterpret_cast<void*>(&JaxdeclDispatchCuda));
    targets["jaxdecl_dispatch_split"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclDispatchSplitCuda));
    targets["jaxdecl_dispatch_eager"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclDispatchEagerCuda));
    return targets;
  }, "FFI targets to pass to jax.ffi.register_ffi_target on 'CUDA' (same names as on CPU).");

  m.def("set_cuda_candidates", &SetCandidates, py::arg("paths"),
        "Where to look for libcudart when JAX's CUDA plugin has loaded none.");

  m.def("copy_on_device", [](uintptr_t dst, uintptr_t src, size_t bytes, uintptr_t stream) {
    const CudaRuntime& rt = RuntimeOrThrow();
    Check(rt, rt.MemcpyAsync(AsPointer(dst), AsPointer(src), bytes, kDeviceToDevice,
                             AsPointer(stream)), "cudaMemcpyAsync (device to device)");
  }, py::arg("dst"), py::arg("src"), py::arg("bytes"), py::arg("stream"),
        "Enqueues a device-to-device copy on `stream`.");

  m.def("zero_on_device", [](uintptr_t dst, size_t bytes, uintptr_t stream) {
    const CudaRuntime& rt = RuntimeOrThrow();
    Check(rt, rt.MemsetAsync(AsPointer(dst), 0, bytes, AsPointer(stream)), "cudaMemsetAsync");
  }, py::arg("dst"), py::arg("bytes"), py::arg("stream"),
        "Enqueues zeroing `bytes` bytes of device memory on `stream`.");

  m.def("synchronize_stream", [](uintptr_t stream) {
    const CudaRuntime& rt = RuntimeOrThrow();
    int code;
    {
      py::gil_scoped_release release;
      code = rt.StreamSynchronize(AsPointer(stream));
    }
    Check(rt, code, "cudaStreamSynchronize");
  }, py::arg("stream"), "Waits (without the GIL) until `stream` is idle.");

  m.def("stream_wait", [](uintptr_t consumer, uintptr_t producer) {
    const CudaRuntime& rt = RuntimeOrThrow();
    void* event = nullptr;
    Check(rt, rt.EventCreateWithFlags(&event, kEventDisableTiming), "cudaEventCreateWithFlags");
    int code = rt.EventRecord(event, AsPointer(producer));
    if (code == 0) code = rt.StreamWaitEvent(AsPointer(consumer), event, 0);
    rt.EventDestroy(event);  // (released once the wait is satisfied)
    Check(rt, code, "making a stream wait for another (cudaStreamWaitEvent)");
  }, py::arg("consumer"), py::arg("producer"),
        "Makes `consumer` wait for the work queued so far on `producer`.");

  m.def("dlpack_capsule", [](py::object owner, uintptr_t address, std::vector<int64_t> shape,
                             int code, int device_type, int device_id, bool read_only,
                             bool versioned) {
    PyObject* capsule = DlpackCapsule(owner.ptr(), address, shape, code, device_type,
                                      device_id, read_only, versioned);
    if (capsule == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(capsule);
  }, py::arg("owner"), py::arg("address"), py::arg("shape"), py::arg("code"),
        py::arg("device_type"), py::arg("device_id"), py::arg("read_only"),
        py::arg("versioned"), "A DLPack capsule of `owner`'s memory at `address`.");

  m.def("cuda_runtime_origin", []() -> py::object {
    std::string error;
    const CudaRuntime* rt = Runtime(&error);
    return rt == nullptr ? py::object(py::none()) : py::object(py::str(rt->origin));
  }, "Where the CUDA runtime the handlers use comes from (loading it if needed), or None.");

  // Tests.
  m.def("use_fake_cuda", &UseFake, py::arg("fail") = "", py::arg("on") = 0,
        py::arg("code") = 0, py::arg("sticky") = false,
        "Tests: the fake CUDA runtime (host memory); `fail` (a function name such as "
        "'MemcpyAsync') fails with `code` on its `on`-th call (and after, if `sticky`).");
  m.def("use_real_cuda", &UseReal, "Tests: the real CUDA runtime again.");
  m.def("fake_cuda_log", &TakeFakeLog,
        "Tests: the fake runtime's calls since the last look, as (function, arguments).");
  m.def("fake_cuda_live", []() { return py::make_tuple(FakeLiveAllocations(), FakeLiveEvents()); },
        "Tests: the fake runtime's live (pinned allocations, events).");

  py::class_<StagedSite>(m, "StagedSite",
                         "Tests: a CUDA call site whose device buffers are host memory.")
      .def(py::init<>())
      .def("run", &StagedSite::Run, py::arg("slot"), py::arg("inputs"), py::arg("outputs"),
           py::arg("ordinal") = 0, py::arg("stream") = 0, py::arg("drop") = 0,
           "Runs the kernel in `slot` as the CUDA handler does; None or the error message.")
      .def("run_eager", [](StagedSite&, std::tuple<uintptr_t, std::vector<int64_t>, int> slot,
                           const Descriptions& inputs, const Descriptions& outputs, int ordinal,
                           uintptr_t stream) -> py::object {
        Descriptions all{slot};
        all.insert(all.end(), inputs.begin(), inputs.end());
        Described described(all, outputs);
        auto args = described.frame.Args();
        auto first = args.get<ffi::AnyBuffer>(0);
        std::string error;
        {
          py::gil_scoped_release release;
          error = RunEager(*first, described.frame.Args(1),
                           described.frame.Rets(), AsPointer(stream), ordinal);
        }
        return error.empty() ? py::object(py::none()) : py::object(py::str(error));
      }, py::arg("slot"), py::arg("inputs"), py::arg("outputs"), py::arg("ordinal") = 0,
         py::arg("stream") = 0,
         "Runs the eager CUDA handler on `slot` (a device scalar) and the buffers.")
      .def("run_compiled", [](StagedSite&, int64_t hi, int64_t lo, const std::string& name,
                              const std::string& recipe, const Descriptions& inputs,
                              const Descriptions& outputs, int ordinal,
                              uintptr_t stream) -> py::object {
        Described described(inputs, outputs);
        std::string error;
        {
          py::gil_scoped_release release;  // as XLA calls the handler
          error = RunCompiled(hi, lo, name, recipe, described.frame.Args(),
                              described.frame.Rets(), AsPointer(stream), ordinal, 0);
        }
        return error.empty() ? py::object(py::none()) : py::object(py::str(error));
      }, py::arg("fingerprint_hi"), py::arg("fingerprint_lo"), py::arg("name"),
         py::arg("recipe"), py::arg("inputs"), py::arg("outputs"), py::arg("ordinal") = 0,
         py::arg("stream") = 0,
         "Runs the compiled CUDA handler: the kernel found by its fingerprint (or rebuilt "
         "from `recipe`), staged through the kernel's pools.")
      .def("pools", &StagedSite::Pools,
           "(ordinal, pinned addresses, capacities) of each pool kept.");
}

}  // namespace jaxdecl::gpu
