// The floating-point environment a rule runs in.
//
// XLA's CPU runtime computes with flush-to-zero and denormals-are-zero set
// (x86 MXCSR 0x9fe2, where Python runs with 0x1fa2), and it keeps them set
// while it calls a custom call.  A rule's NumPy (or C) code would then turn
// subnormal numbers into zeros inside a jitted program and keep them outside
// it: the same rule, different bits.  So every rule runs in the environment
// the process had when jaxdecl was imported (Python's usual one), and XLA's
// is put back after it.  Reading and writing the control register costs a few
// nanoseconds.

#ifndef JAXDECL_CSRC_FP_ENV_H_
#define JAXDECL_CSRC_FP_ENV_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define JAXDECL_FP_ENV_X86 1
#elif defined(__aarch64__)
#define JAXDECL_FP_ENV_ARM64 1
#endif

namespace jaxdecl {

#if defined(JAXDECL_FP_ENV_X86)
using FpControl = unsigned int;
inline FpControl ReadFpControl() { return _mm_getcsr(); }
inline void WriteFpControl(FpControl value) { _mm_setcsr(value); }
#elif defined(JAXDECL_FP_ENV_ARM64)
using FpControl = uint64_t;
inline FpControl ReadFpControl() {
  uint64_t value;
  __asm__ __volatile__("mrs %0, fpcr" : "=r"(value));
  return value;
}
inline void WriteFpControl(FpControl value) {
  __asm__ __volatile__("msr fpcr, %0" : : "r"(value));
}
#else
using FpControl = int;  // elsewhere the environment is left as it is
inline FpControl ReadFpControl() { return 0; }
inline void WriteFpControl(FpControl) {}
#endif

// The environment rules run in: recorded when the module is imported.
FpControl& RuleFpControl();

// For one rule call: the rule's environment from construction, the caller's
// (XLA's) back on destruction.
class RuleFpEnvironment {
 public:
  RuleFpEnvironment() : saved_(ReadFpControl()) {
    if (saved_ != RuleFpControl()) WriteFpControl(RuleFpControl());
  }
  ~RuleFpEnvironment() {
    if (ReadFpControl() != saved_) WriteFpControl(saved_);  // the rule may change it too
  }
  RuleFpEnvironment(const RuleFpEnvironment&) = delete;
  RuleFpEnvironment& operator=(const RuleFpEnvironment&) = delete;

 private:
  FpControl saved_;
};

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_FP_ENV_H_
