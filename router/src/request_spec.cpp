#include "kdn/router/request_spec.h"

namespace kdn::router {

const char* DisaggregationName(Disaggregation d) {
  switch (d) {
    case Disaggregation::kAlways: return "always";
    case Disaggregation::kAuto: return "auto";
    case Disaggregation::kNever: return "never";
  }
  return "?";
}

std::optional<Disaggregation> ParseDisaggregation(const std::string& s) {
  for (Disaggregation d :
       {Disaggregation::kAlways, Disaggregation::kAuto, Disaggregation::kNever}) {
    if (s == DisaggregationName(d)) return d;
  }
  return std::nullopt;
}

}  // namespace kdn::router
