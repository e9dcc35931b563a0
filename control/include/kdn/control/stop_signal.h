#pragma once
// The processes' main loop: serve until SIGINT or SIGTERM. Main thread only.

namespace kdn::control {

// From now on SIGINT and SIGTERM only ask the process to stop.
void CatchStopSignals();

// Blocks until SIGINT or SIGTERM has arrived (after CatchStopSignals).
void WaitForStopSignal();

}  // namespace kdn::control
