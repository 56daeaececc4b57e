// Helpers the native CPU kernels share (included by cpu_attention.cc and cpu_matmul.cc; native_build.py keys
// each build on this header too).
#pragma once

// Tells the core this thread is spin-waiting (on another thread's share of a call's work).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
