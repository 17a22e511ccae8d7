// jaxdecl._dispatch: the Python face of the FFI handler in handler.cc.

#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#include <numpy/arrayobject.h>

#include <pybind11/pybind11.h>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace py = pybind11;
namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxdeclDispatch);

namespace {

jaxdecl_kernel ToFunction(uintptr_t address) {
  if (address == 0) throw py::value_error("a C kernel address must not be 0");
  return reinterpret_cast<jaxdecl_kernel>(address);
}

int64_t Register(jaxdecl::Kernel kernel) {
  int64_t key = jaxdecl::RegisterKernel(kernel);
  if (key < 0) throw std::runtime_error("jaxdecl: the kernel registry is full");
  return key;
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
  m.doc() = "jaxdecl's XLA FFI dispatcher (CPU).";
  if (_import_array() < 0) throw py::error_already_set();
  if (!jaxdecl::Initialize()) throw py::error_already_set();

  m.def("registrations", []() {
    py::dict targets;
    targets["jaxdecl_dispatch"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclDispatch));
    return targets;
  }, "FFI targets to pass to jax.ffi.register_ffi_target (platform 'cpu').");

  m.def("register_kernel", [](py::object call, py::object on_escape) {
    jaxdecl::Kernel kernel;
    kernel.call = call.release().ptr();  // owned for the process's lifetime
    kernel.on_escape = on_escape.release().ptr();
    return Register(kernel);
  }, py::arg("call"), py::arg("on_escape"),
        "Stores a Python host kernel for the process's lifetime; returns its key.");

  m.def("register_c_kernel", [](uintptr_t address, py::object keepalive) {
    jaxdecl::Kernel kernel;
    kernel.c_function = ToFunction(address);
    kernel.keepalive = keepalive.release().ptr();
    return Register(kernel);
  }, py::arg("address"), py::arg("keepalive"),
        "Stores a C kernel (jaxdecl.h) for the process's lifetime; returns its key.");

  m.def("call_c_kernel", [](uintptr_t address, py::tuple inputs,
                            py::tuple outputs) -> py::object {
    std::string error =
        jaxdecl::CallCKernel(ToFunction(address), inputs.ptr(), outputs.ptr());
    if (error.empty()) return py::none();
    return py::str(error);
  }, py::arg("address"), py::arg("inputs"), py::arg("outputs"),
        "Runs a C kernel on NumPy arrays; returns None or its error message.");

  m.def("set_dtype", [](int code, py::object dtype) {
    if (code < 0 || code >= 256) throw py::value_error("element type code out of range");
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(dtype.ptr(), &descr)) throw py::error_already_set();
    jaxdecl::SetDescr(code, reinterpret_cast<PyObject*>(descr));
  }, py::arg("code"), py::arg("dtype"), "Maps an XLA element type code to a NumPy dtype.");

  m.def("set_worker_hooks", [](py::object enter, py::object exit) {
    jaxdecl::SetWorkerHooks(enter.ptr(), exit.ptr());
  }, py::arg("enter"), py::arg("exit"),
        "Hooks run around kernels on XLA worker threads: enter() -> token, exit(token).");

  m.def("element_types", &ElementTypes, "XLA element type codes by NumPy dtype name.");
  m.def("kernel_count", &jaxdecl::KernelCount, "How many kernels are registered.");
}
