#pragma once
// Reading a request body's fields, each refused by name (ApiError::param)
// when it has the wrong type; null counts as absent and leaves *out as it
// was (its default). Private to router/src (openai.cpp, openai_documents.cpp). Thread-safe.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kdn/router/openai.h"

namespace kdn::router {

// Returns the ApiError `expr` gives, if any.
#define KDN_API_CHECK(expr)          \
  do {                               \
    if (auto _e = (expr)) return _e; \
  } while (0)

// Whether `name` is in the body with a value other than null (null counts
// as absent, as for every optional field).
bool IsSet(const json& body, const char* name);

// A 400 invalid_request_error about `param`.
ApiError Bad(std::string message, std::string param = {});
// "a string", "an array", ...: for messages.
const char* TypeName(const json& v);
std::optional<ApiError> GetInt(const json& body, const char* name, int64_t* out);
std::optional<ApiError> GetNumber(const json& body, const char* name, double* out);
std::optional<ApiError> GetBool(const json& body, const char* name, bool* out);
// An array of integers, or of numbers; *out is replaced when present.
std::optional<ApiError> GetIntArray(const json& body, const char* name, std::vector<int>* out);
std::optional<ApiError> GetNumberArray(const json& body, const char* name,
                                       std::vector<double>* out);
std::optional<ApiError> GetString(const json& body, const char* name, std::string* out);

}  // namespace kdn::router
