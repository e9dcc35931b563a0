#include "kdn/router/api_keys.h"

#include <boost/beast/core/detail/base64.hpp>

#include <fstream>
#include <set>
#include <sstream>

namespace kdn::router {

namespace {

// Equal bytes, in time that depends on the lengths only.
bool SameBytes(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace

Result<ApiKeys> ApiKeys::Load(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return NotFound("api keys: cannot read " + file.string());
  std::stringstream text;
  text << in.rdbuf();
  return Parse(text.str(), file.string());
}

Result<ApiKeys> ApiKeys::Parse(std::string_view text, std::string_view source) {
  ApiKeys keys;
  std::set<std::string> seen;
  std::istringstream lines{std::string(text)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::istringstream fields(line);
    std::string key, tenant, extra;
    if (!(fields >> key) || key[0] == '#') continue;
    const std::string where = std::string(source) + ":" + std::to_string(number);
    if (!(fields >> tenant))
      return InvalidArgument("api keys: " + where + ": a key without a tenant");
    if (fields >> extra) {
      return InvalidArgument("api keys: " + where + ": expected \"KEY TENANT\", found more");
    }
    if (key.size() < kMinKeyBytes) {
      return InvalidArgument("api keys: " + where + ": a key of " + std::to_string(key.size()) +
                             " characters; at least " + std::to_string(kMinKeyBytes));
    }
    if (!seen.insert(key).second)
      return InvalidArgument("api keys: " + where + ": a key given twice");
    keys.keys_.emplace_back(std::move(key), std::move(tenant));
  }
  if (keys.keys_.empty())
    return InvalidArgument("api keys: " + std::string(source) + " has no key");
  return keys;
}

const std::string* ApiKeys::TenantOf(std::string_view authorization) const {
  constexpr std::string_view kBearer = "Bearer ";
  constexpr std::string_view kBasic = "Basic ";
  auto starts = [&](std::string_view scheme) {
    return authorization.size() > scheme.size() &&
           SameBytes(authorization.substr(0, scheme.size()), scheme);
  };
  std::string_view presented;
  std::string decoded;
  if (starts(kBearer)) {
    presented = authorization.substr(kBearer.size());
  } else if (starts(kBasic)) {
    // A browser's credentials: base64 of "USER:PASSWORD", the key the
    // password, any user name.
    const std::string_view b64 = authorization.substr(kBasic.size());
    decoded.resize(boost::beast::detail::base64::decoded_size(b64.size()));
    const auto [written, read] =
        boost::beast::detail::base64::decode(decoded.data(), b64.data(), b64.size());
    // It stops at the padding: all of the rest must be padding.
    if (b64.find_first_not_of('=', read) != std::string_view::npos || b64.size() - read > 2) {
      return nullptr;
    }
    decoded.resize(written);
    const size_t colon = decoded.find(':');
    if (colon == std::string::npos) return nullptr;
    presented = std::string_view(decoded).substr(colon + 1);
  } else {
    return nullptr;
  }
  const std::string* tenant = nullptr;
  for (const auto& [key, owner] : keys_) {
    if (SameBytes(presented, key)) tenant = &owner;  // no early exit
  }
  return tenant;
}

size_t ApiKeys::tenants() const {
  std::set<std::string_view> t;
  for (const auto& [key, tenant] : keys_) t.insert(tenant);
  return t.size();
}

std::string RequestNamespace(const std::string* tenant, const std::string& cache_salt) {
  if (tenant == nullptr) return cache_salt;
  return "tenant:" + std::to_string(tenant->size()) + ":" + *tenant + ":" + cache_salt;
}

}  // namespace kdn::router
