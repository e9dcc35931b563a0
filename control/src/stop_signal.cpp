#include "kdn/control/stop_signal.h"

#include <chrono>
#include <csignal>
#include <thread>

namespace kdn::control {

namespace {
volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }
}  // namespace

void CatchStopSignals() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
}

void WaitForStopSignal() {
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

}  // namespace kdn::control
