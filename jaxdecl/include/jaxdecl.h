/* jaxdecl C kernel interface.
 *
 * A rule can be a plain C function instead of a Python method: jaxdecl's XLA
 * handler then calls it directly on XLA's buffers, without the GIL and without
 * Python.  Declare it in the class with
 *
 *     apply = jd.forward(jd.cfunction(address_or_capsule_or_ctypes_function))
 *
 * The function receives the rule's operands and results in the order the
 * Python rule would (see jaxdecl/_layout.py), as dense row-major buffers.
 * It must be thread-safe: XLA may call it concurrently from several threads.
 */
#ifndef JAXDECL_H_
#define JAXDECL_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types (the XLA FFI codes). */
enum jaxdecl_dtype {
  JAXDECL_BOOL = 1,
  JAXDECL_INT8 = 2,
  JAXDECL_INT16 = 3,
  JAXDECL_INT32 = 4,
  JAXDECL_INT64 = 5,
  JAXDECL_UINT8 = 6,
  JAXDECL_UINT16 = 7,
  JAXDECL_UINT32 = 8,
  JAXDECL_UINT64 = 9,
  JAXDECL_FLOAT16 = 10,
  JAXDECL_FLOAT32 = 11,
  JAXDECL_FLOAT64 = 12,
  JAXDECL_COMPLEX64 = 15,
  JAXDECL_BFLOAT16 = 16,
  JAXDECL_COMPLEX128 = 18
};

typedef struct jaxdecl_buffer {
  void* data;           /* dense, row-major; 64-byte aligned when from XLA */
  const int64_t* dims;  /* `rank` extents */
  int64_t rank;
  int32_t dtype;        /* a jaxdecl_dtype */
} jaxdecl_buffer;

/* Returns 0 on success.  On failure returns non-zero and may write a
 * NUL-terminated message of at most `message_size` bytes into `message`,
 * which jaxdecl raises as the op's error. */
typedef int (*jaxdecl_kernel)(const jaxdecl_buffer* inputs, int64_t num_inputs,
                              const jaxdecl_buffer* outputs, int64_t num_outputs,
                              char* message, int64_t message_size);

/* A C kernel for the GPU, a device rule:
 *
 *     apply_gpu = jd.forward(jd.cfunction(fn, platform="gpu"))
 *
 * The signature above plus XLA's CUDA stream (a cudaStream_t): the
 * buffers' `data` are device pointers of the call's device (already the
 * current one), and the function enqueues its work on `stream` and returns
 * without synchronising.  0 on success, as above. */
typedef int (*jaxdecl_gpu_kernel)(const jaxdecl_buffer* inputs, int64_t num_inputs,
                                  const jaxdecl_buffer* outputs, int64_t num_outputs,
                                  char* message, int64_t message_size, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* JAXDECL_H_ */
