// DLPack capsules (dlpack.h).

#include "dlpack.h"

#include <cstring>

namespace jaxdecl::gpu {
namespace {

// DLPack's ABI.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // null: dense, row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kReadOnly = 1;  // DLPACK_FLAG_BITMASK_READ_ONLY

// Owns what a capsule's tensor points to, and a reference to the memory's owner.
struct Holder {
  PyObject* owner;
  std::vector<int64_t> shape;
  DLManagedTensor legacy{};
  DLManagedTensorVersioned versioned{};
};

void Release(Holder* holder) {
  if (Py_IsInitialized()) {
    PyGILState_STATE gil = PyGILState_Ensure();  // the consumer may call without it
    Py_XDECREF(holder->owner);
    PyGILState_Release(gil);
  }
  delete holder;
}

void DeleteLegacy(DLManagedTensor* self) { Release(static_cast<Holder*>(self->manager_ctx)); }

void DeleteVersioned(DLManagedTensorVersioned* self) {
  Release(static_cast<Holder*>(self->manager_ctx));
}

// A capsule nobody consumed (still named "dltensor..."): its tensor is ours to delete.
void DestroyCapsule(PyObject* capsule) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  const char* name = PyCapsule_GetName(capsule);
  if (name != nullptr && std::strcmp(name, "dltensor") == 0) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, name));
    if (tensor != nullptr) tensor->deleter(tensor);
  } else if (name != nullptr && std::strcmp(name, "dltensor_versioned") == 0) {
    auto* tensor = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, name));
    if (tensor != nullptr) tensor->deleter(tensor);
  }
  PyErr_Clear();
  PyErr_Restore(type, value, traceback);
}

bool DataTypeOf(int code, DLDataType* out) {
  switch (code) {
    case 1: *out = {6, 8, 1}; return true;                   // PRED
    case 2: case 3: case 4: case 5:                           // S8..S64
      *out = {0, static_cast<uint8_t>(8 << (code - 2)), 1}; return true;
    case 6: case 7: case 8: case 9:                           // U8..U64
      *out = {1, static_cast<uint8_t>(8 << (code - 6)), 1}; return true;
    case 10: *out = {2, 16, 1}; return true;                  // F16
    case 11: *out = {2, 32, 1}; return true;                  // F32
    case 12: *out = {2, 64, 1}; return true;                  // F64
    case 15: *out = {5, 64, 1}; return true;                  // C64
    case 16: *out = {4, 16, 1}; return true;                  // BF16
    case 18: *out = {5, 128, 1}; return true;                 // C128
    default: return false;
  }
}

}  // namespace

PyObject* DlpackCapsule(PyObject* owner, uintptr_t address, const std::vector<int64_t>& shape,
                        int code, int device_type, int device_id, bool read_only,
                        bool versioned) {
  DLDataType dtype;
  if (!DataTypeOf(code, &dtype)) {
    PyErr_Format(PyExc_TypeError, "element type %d has no DLPack equivalent", code);
    return nullptr;
  }
  auto* holder = new Holder{owner, shape};
  Py_INCREF(owner);
  DLTensor tensor{reinterpret_cast<void*>(address), {device_type, device_id},
                  static_cast<int32_t>(shape.size()), dtype,
                  holder->shape.empty() ? nullptr : holder->shape.data(), nullptr, 0};
  void* pointer;
  const char* name;
  if (versioned) {
    holder->versioned = DLManagedTensorVersioned{
        {1, 0}, holder, &DeleteVersioned, read_only ? kReadOnly : 0, tensor};
    pointer = &holder->versioned;
    name = "dltensor_versioned";
  } else {
    holder->legacy = DLManagedTensor{tensor, holder, &DeleteLegacy};
    pointer = &holder->legacy;
    name = "dltensor";
  }
  PyObject* capsule = PyCapsule_New(pointer, name, &DestroyCapsule);
  if (capsule == nullptr) Release(holder);
  return capsule;
}

}  // namespace jaxdecl::gpu
