#pragma once
// API keys (docs/serving.md, "API keys"): each key belongs to a tenant, and
// the tenant fixes the cache namespace of its requests, so that tenants
// never share chunks nor learn from `cached_tokens` what another one sent.
// Thread-safe (immutable after Load).

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::router {

class ApiKeys {
 public:
  // The shortest key accepted: shorter ones are guessable.
  static constexpr size_t kMinKeyBytes = 16;

  // Reads a key file: one key per line, "KEY TENANT" separated by blanks;
  // blank lines and lines starting with '#' are skipped. INVALID_ARGUMENT,
  // naming the file and line, for a line without a tenant or with more than
  // two fields, a key under kMinKeyBytes, a key given twice, or a file with
  // no key; NOT_FOUND for a file that cannot be read.
  static Result<ApiKeys> Load(const std::filesystem::path& file);
  static Result<ApiKeys> Parse(std::string_view text, std::string_view source);

  // The tenant of the credential in an Authorization header's value
  // ("Bearer KEY", or a browser's "Basic" credentials with the key as the
  // password and any user name), or null when it names no key. Every configured key is
  // compared in full, whatever matches, so the time taken tells nothing of
  // how much of a key was right.
  const std::string* TenantOf(std::string_view authorization) const;

  size_t size() const { return keys_.size(); }
  size_t tenants() const;

 private:
  std::vector<std::pair<std::string, std::string>> keys_;  // key, tenant
};

// The cache namespace of a request. Without keys (tenant null) it is the
// request's cache_salt, as before keys existed. With one it is the tenant's
// own namespace, narrowed by the salt: the tenant's length is part of it, so
// no tenant and salt can spell another tenant's namespace.
std::string RequestNamespace(const std::string* tenant, const std::string& cache_salt);

}  // namespace kdn::router
