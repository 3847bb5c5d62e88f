// Exceptions inside OpenMP parallel regions. An exception that leaves a region ends the process
// (the runtime calls std::terminate), so a failed allocation of a thread's scratch rows would kill
// the caller's program instead of reaching it as an error. Each thread runs its work through
// FirstError::run, which keeps the first exception and turns the rest of every thread's work into
// no-ops (threads still reach the region's barriers); the caller rethrows after the region.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

#include "isa.h"

SDPA_MATH_CPU_BEGIN

class FirstError {
 public:
  template <class F>
  void run(F&& work) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  // After the region: the first exception, if any thread had one.
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex mutex_;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
};

SDPA_MATH_CPU_END
