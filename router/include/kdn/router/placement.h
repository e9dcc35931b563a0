#pragma once
// Placement: which worker takes what, as pure functions of what workers
// reported (WorkerView, read-only) and of the router's own reservations since
// (Ledger). No I/O, no clock: tests drive it without sockets
// (tests/router/placement_test.cpp). The rules (docs/serving.md, "Routing"):
//   prefill   the worker with the least work for the request: the prompt
//             tokens it must compute (all but the prefix it reaches, the last
//             token always; a blend request's held documents at their
//             recompute share) plus the tokens queued at it; at equal work,
//             the one whose KV pool holds more of the prefix resident;
//   decode    among workers with room (KV blocks for what the request needs
//             now, KvTokensAdmitted: its tokens and a block to grow; a
//             blend request's whole length; and a place in its batch), the
//             one holding most of the prompt (none counts for a blend
//             request), then the one holding more of it resident in its
//             pool, then the least busy. None with room: the request waits
//             if one could ever hold it whole (prompt + max_tokens), else it
//             is refused;
//   retry     a prefill lost before its first token goes to the other
//             prefill worker with the fewest queued tokens;
//   document  an injection's document goes to the prefill worker with the
//             fewest documents in flight, below a cap, then the fewest queued
//             tokens;
//   path      with both workers chosen, whether the decode worker computes
//             the prompt itself (local prefill) instead of the prefill
//             worker: PrefillLocally's cost model.
// Only workers with a lookup answer (a prefix >= 0: their own, their KV
// events', or 0 for a live worker silent past the lookup's deadline) are
// candidates for a request; only usable ones (up, compatible, of the role)
// for anything.
//
// Thread-compatible: values, and const references the caller keeps alive.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "kdn/common/kv_block.h"
#include "kdn/router/request_spec.h"
#include "kdn/router/worker_view.h"

namespace kdn::router {

// The router's reservations per worker (WorkerView::reserved): what it
// routed since each worker's last report. A report clears its row.
class Ledger {
 public:
  explicit Ledger(size_t workers = 0) : rows_(workers) {}

  // A request routed: a place and `kv_blocks` at decode worker `decode`,
  // `prompt_tokens` to compute at prefill worker `prefill`.
  void Reserve(size_t prefill, size_t decode, int64_t prompt_tokens, int64_t kv_blocks);
  // A request routed to be prefilled at decode worker `decode` itself,
  // `prompt_tokens` of it to compute there.
  void ReserveLocal(size_t decode, int64_t prompt_tokens, int64_t kv_blocks);
  // Decode worker `decode` refused a prepare for want of KV: none is free
  // there until it reports again.
  void MarkFull(size_t decode, const WorkerView& reported);
  // Worker `w` reported: its report shows what was reserved.
  void Clear(size_t w) { rows_.at(w) = {}; }
  const Reservation& at(size_t w) const { return rows_.at(w); }
  size_t size() const { return rows_.size(); }

 private:
  std::vector<Reservation> rows_;
};

// Worker `w` as placement counts it: reported, less what was reserved since.
struct Load {
  int queue_depth = 0;
  int64_t free_kv_blocks = 0;
  int64_t queue_tokens = 0;
};
Load LoadOf(const WorkerView& reported, const Reservation& reserved);

// What placement reads of one request.
struct PlacementInput {
  int64_t tokens = 0;  // the prompt as sent (a resumed one's generated tokens included)
  // What a decode worker takes now (KvBlocksFor(KvTokensAdmitted(...))), and
  // what the request takes at its longest (prompt + max_tokens): a worker
  // whose pool is smaller can never serve it.
  int64_t kv_blocks = 0;
  int64_t kv_blocks_whole = 0;
  const BlendSpec* blend = nullptr;  // null: no documents
  // The lookup's answers: worker -> leading prompt tokens whose KV it
  // reaches (-1: no answer), and for a blend request the document tokens
  // it holds.
  const std::map<size_t, int64_t>* prefix = nullptr;
  const std::map<size_t, int64_t>* segment_tokens_held = nullptr;
  // Of each worker's prefix, the tokens resident in its KV pool (attached
  // with no KV moved); null or absent: none.
  const std::map<size_t, int64_t>* resident = nullptr;
  bool resumed = false;  // its decode worker was lost before (a resume)
};

using WorkerViews = std::vector<WorkerView>;

// The prefill worker for the request; none when no usable one answered.
std::optional<size_t> PlacePrefill(const WorkerViews& workers, const Ledger& ledger,
                                   const PlacementInput& in);

struct DecodePlacement {
  enum class Verdict {
    kRoute,     // to `worker`
    kWait,      // none has room now, one could hold it: the admission queue
    kNoneUp,    // no usable decode worker answered
    kTooLarge,  // no decode worker could ever hold it
  };
  Verdict verdict = Verdict::kNoneUp;
  size_t worker = 0;
};
DecodePlacement PlaceDecode(const WorkerViews& workers, const Ledger& ledger,
                            const PlacementInput& in);

// The prompt tokens worker `w` would compute for the request: all but the
// prefix its lookup reached (none when it did not answer), the last token
// always (its logits draw the first token).
int64_t TokensToCompute(const PlacementInput& in, size_t w);

// Where the prompt of a request placed at prefill worker `p` and decode
// worker `d` is computed (docs/serving.md, "Two paths"): true for a local
// prefill at `d`. Never for a blended or resumed request. kNever: always
// else; kAlways: never. kAuto, in estimated prefill tokens of time:
//   local   the tokens `d` lacks (the prompt less what it reaches, the last
//           token always) plus its local backlog, and, while requests run
//           there, one decode step per piece of its step tokens (the step's
//           time in tokens from its reported averages; a step counts as a
//           piece before it has any);
//   remote  the tokens `p` lacks plus the tokens queued at it;
// local when the tokens `d` lacks are at most `max_local_tokens` and local
// costs no more than remote (at equal cost local also saves moving the KV).
bool PrefillLocally(const WorkerViews& workers, const Ledger& ledger, const PlacementInput& in,
                    size_t p, size_t d, Disaggregation mode, int64_t max_local_tokens);

// The prefill worker that takes over a prefill lost with worker `lost`; none
// when no other usable prefill worker is left.
std::optional<size_t> PlaceRetry(const WorkerViews& workers, const Ledger& ledger, size_t lost);

// The prefill worker for an injection's next document, given the documents
// in flight per worker (indexed like `workers`); none when every usable one
// has `per_worker` in flight, or none is usable.
std::optional<size_t> PlaceDocument(const WorkerViews& workers, const Ledger& ledger,
                                    const std::vector<int>& in_flight, int per_worker);

}  // namespace kdn::router
