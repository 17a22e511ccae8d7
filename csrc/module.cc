// jaxdecl._dispatch: the Python face of the FFI handlers (handler.cc,
// call_site.cc) and of the kernel registry (registry.h).

#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#include <numpy/arrayobject.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "gpu/gpu.h"
#include "kernels.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;
namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatch);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatchSplit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatchEager);

namespace {

jaxdecl_kernel ToFunction(uintptr_t address) {
  if (address == 0) throw py::value_error("a C kernel address must not be 0");
  return reinterpret_cast<jaxdecl_kernel>(address);
}

std::unique_ptr<jaxdecl::Kernel> NewKernel(int64_t hi, int64_t lo,
                                           std::string name) {
  auto kernel = std::make_unique<jaxdecl::Kernel>();
  kernel->fingerprint = {static_cast<uint64_t>(hi), static_cast<uint64_t>(lo)};
  kernel->name = std::move(name);
  return kernel;
}

// A device rule (platform="gpu") for the CUDA handlers: a Python device kernel,
// or a C function taking the stream (jaxdecl_gpu_kernel) and what owns its code.
void SetDeviceRule(jaxdecl::Kernel& kernel, py::object device_call, uintptr_t gpu_address,
                   py::object gpu_keepalive) {
  if (!device_call.is_none()) kernel.device_call = device_call.release().ptr();
  if (gpu_address != 0) {
    kernel.gpu_function = reinterpret_cast<jaxdecl_gpu_kernel>(gpu_address);
    kernel.gpu_keepalive = gpu_keepalive.release().ptr();
  }
}

py::dict ElementTypes() {
  py::dict codes;
  auto put = [&](const char* name, ffi::DataType type) {
    codes[name] = static_cast<int>(type);
  };
  put("bool", ffi::DataType::PRED);
  put("int8", ffi::DataType::S8);
  put("int16", ffi::DataType::S16);
  put("int32", ffi::DataType::S32);
  put("int64", ffi::DataType::S64);
  put("uint8", ffi::DataType::U8);
  put("uint16", ffi::DataType::U16);
  put("uint32", ffi::DataType::U32);
  put("uint64", ffi::DataType::U64);
  put("float16", ffi::DataType::F16);
  put("bfloat16", ffi::DataType::BF16);
  put("float32", ffi::DataType::F32);
  put("float64", ffi::DataType::F64);
  put("complex64", ffi::DataType::C64);
  put("complex128", ffi::DataType::C128);
  return codes;
}

}  // namespace

PYBIND11_MODULE(_dispatch, m) {
  m.doc() = "jaxdecl's XLA FFI dispatcher (CPU and CUDA).";
  if (_import_array() < 0) throw py::error_already_set();
  if (!jaxdecl::Initialize()) throw py::error_already_set();

  // The XLA FFI API version of the headers the dispatcher is built against
  // (csrc/third_party): a jaxlib accepts it while it is within its supported range.
  m.attr("FFI_API_VERSION") = py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);

  m.def("registrations", []() {
    py::dict targets, compiled;
    compiled["instantiate"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclInstantiate));
    compiled["execute"] = py::capsule(reinterpret_cast<void*>(&JaxdeclDispatch));
    targets["jaxdecl_dispatch"] = compiled;
    py::dict split;
    split["instantiate"] = compiled["instantiate"];
    split["execute"] = py::capsule(reinterpret_cast<void*>(&JaxdeclDispatchSplit));
    targets["jaxdecl_dispatch_split"] = split;
    targets["jaxdecl_dispatch_eager"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclDispatchEager));
    return targets;
  }, "FFI targets to pass to jax.ffi.register_ffi_target (platform 'cpu'): a "
        "capsule, or a dict of capsules by execution stage.");

  m.def("call_site_type", []() {
    py::dict registration;
    registration["type_id"] = py::capsule(jaxdecl::CallSiteTypeId());
    registration["type_info"] = py::capsule(const_cast<void*>(jaxdecl::CallSiteTypeInfo()));
    return registration;
  }, "The FFI state type of compiled call sites, for jax.ffi.register_ffi_type.");

  m.def("register_kernel", [](int64_t hi, int64_t lo, std::string name,
                              py::object call, py::object on_escape,
                              py::object instance_ref, py::object direct,
                              py::object on_failure, std::vector<int64_t> rows,
                              py::object device_call, uintptr_t gpu_address,
                              py::object gpu_keepalive, std::vector<int> gpu_operands) {
    if (!instance_ref.is_none() && !PyWeakref_Check(instance_ref.ptr())) {
      throw py::type_error("instance_ref must be a weak reference or None");
    }
    auto kernel = NewKernel(hi, lo, std::move(name));
    SetDeviceRule(*kernel, device_call, gpu_address, gpu_keepalive);
    kernel->call = call.release().ptr();
    kernel->on_escape = on_escape.release().ptr();
    if (!instance_ref.is_none()) kernel->instance_ref = instance_ref.release().ptr();
    if (!direct.is_none() && !on_failure.is_none()) {
      kernel->direct = direct.release().ptr();
      kernel->on_failure = on_failure.release().ptr();
    }
    kernel->row_dims = std::move(rows);
    kernel->c_operands = std::move(gpu_operands);  // (what a GPU C device rule takes)
    return jaxdecl::RegisterKernel(std::move(kernel));
  }, py::arg("fingerprint_hi"), py::arg("fingerprint_lo"), py::arg("name"),
        py::arg("call"), py::arg("on_escape"), py::arg("instance_ref"),
        py::arg("direct") = py::none(), py::arg("on_failure") = py::none(),
        py::arg("rows") = std::vector<int64_t>(), py::arg("device_call") = py::none(),
        py::arg("gpu_address") = 0, py::arg("gpu_keepalive") = py::none(),
        py::arg("gpu_operands") = std::vector<int>(),
        "Registers a Python host kernel until release_kernel; returns its slot. "
        "`rows`: the batch dims of batch=\"loop\", run a row at a time; `device_call` or "
        "`gpu_address`: a device rule (platform=\"gpu\"), which CUDA runs instead.");

  m.def("register_c_kernel", [](int64_t hi, int64_t lo, std::string name,
                                uintptr_t address, py::object keepalive,
                                std::vector<int> operands, std::vector<int64_t> rows,
                                int conj_from, py::object device_call, uintptr_t gpu_address,
                                py::object gpu_keepalive) {
    auto kernel = NewKernel(hi, lo, std::move(name));
    SetDeviceRule(*kernel, device_call, gpu_address, gpu_keepalive);
    kernel->c_function = ToFunction(address);
    kernel->keepalive = keepalive.release().ptr();
    kernel->c_operands = std::move(operands);
    kernel->row_dims = std::move(rows);
    kernel->c_conj_from = conj_from;
    return jaxdecl::RegisterKernel(std::move(kernel));
  }, py::arg("fingerprint_hi"), py::arg("fingerprint_lo"), py::arg("name"),
        py::arg("address"), py::arg("keepalive"),
        py::arg("operands") = std::vector<int>(), py::arg("rows") = std::vector<int64_t>(),
        py::arg("conj_from") = -1, py::arg("device_call") = py::none(),
        py::arg("gpu_address") = 0, py::arg("gpu_keepalive") = py::none(),
        "Registers a C kernel (jaxdecl.h) until release_kernel; returns its slot. "
        "`operands`: the indices it takes (all if empty); `rows`: the batch dims of "
        "batch=\"loop\"; `conj_from`: an adjoint's first conjugated operand, or -1; "
        "`device_call`/`gpu_address`: a device rule, as for register_kernel.");

  m.def("set_row_threads", &jaxdecl::SetRowThreads, py::arg("threads"),
        "The most threads one call's rows run on (a looped C kernel's, on XLA's "
        "intra-op pool): 0 for as many as the pool has, 1 for in sequence. "
        "JAXDECL_ROW_THREADS sets it at start-up.");
  m.def("row_threads", &jaxdecl::RowThreads, "See set_row_threads.");

  m.def("release_kernel", &jaxdecl::ReleaseKernel, py::arg("slot"),
        "Drops a registration; False if the slot held none.");

  m.def("set_dtype", [](int code, py::object dtype) {
    if (code < 0 || code >= 256) throw py::value_error("element type code out of range");
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(dtype.ptr(), &descr)) throw py::error_already_set();
    jaxdecl::SetDescr(code, reinterpret_cast<PyObject*>(descr));
  }, py::arg("code"), py::arg("dtype"), "Maps an XLA element type code to a NumPy dtype.");

  m.def("set_collect", [](py::object collect) { jaxdecl::SetCollect(collect.ptr()); },
        py::arg("collect"),
        "The callable run before an escaped view is reported (default gc.collect).");

  m.def("set_worker_guard", [](py::object state, py::str name, py::object value) {
    jaxdecl::SetWorkerGuard(state.is_none() ? nullptr : state.ptr(), name.ptr(), value.ptr());
  }, py::arg("state"), py::arg("name"), py::arg("value"),
        "Around kernels on XLA's worker threads, sets attribute `name` of the thread's "
        "state() to `value` (restored after the call).");

  m.def("set_resolver", [](py::object resolver) {
    jaxdecl::SetResolver(resolver.is_none() ? nullptr : resolver.ptr());
  }, py::arg("resolver"),
        "The callable that rebuilds a compiled call site's kernel from its recipe: "
        "resolver(recipe: bytes) -> (slot, op instance or None).");

  m.def("element_types", &ElementTypes, "XLA element type codes by NumPy dtype name.");
  m.def("kernel_count", &jaxdecl::KernelCount, "How many kernels are registered now.");
  m.def("release_pending", &jaxdecl::ReleasePending,
        "Drops now the references that destroyed call sites left to drop later.");
  m.def("call_site_count", &jaxdecl::CallSiteCount,
        "How many call sites of live compiled executables hold a kernel.");

  jaxdecl::gpu::DefineModule(m);  // the CUDA handlers, device rules, their tests
}
