#include "json_fields.h"

#include <cmath>

namespace kdn::router {

bool IsSet(const json& body, const char* name) {
  auto it = body.find(name);
  return it != body.end() && !it->is_null();
}

ApiError Bad(std::string message, std::string param) {
  ApiError e;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

std::optional<ApiError> GetInt(const json& body, const char* name, int64_t* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_integer() || it->is_number_unsigned()) {
    *out = it->get<int64_t>();
    return std::nullopt;
  }
  if (it->is_number_float() && std::floor(it->get<double>()) == it->get<double>() &&
      std::fabs(it->get<double>()) < 9e15) {
    *out = static_cast<int64_t>(it->get<double>());
    return std::nullopt;
  }
  return Bad(std::string("'") + name + "' must be an integer, not " + TypeName(*it), name);
}

std::optional<ApiError> GetNumber(const json& body, const char* name, double* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return Bad(std::string("'") + name + "' must be a number, not " + TypeName(*it), name);
  }
  *out = it->get<double>();
  return std::nullopt;
}

std::optional<ApiError> GetIntArray(const json& body, const char* name, std::vector<int>* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  const std::string bad = std::string("'") + name + "' must be an array of integers";
  if (!it->is_array()) return Bad(bad + ", not " + TypeName(*it), name);
  std::vector<int> v;
  for (const json& e : *it) {
    if (!e.is_number() || std::floor(e.get<double>()) != e.get<double>() ||
        std::fabs(e.get<double>()) > 1e9) {
      return Bad(bad, name);
    }
    v.push_back(static_cast<int>(e.get<double>()));
  }
  *out = std::move(v);
  return std::nullopt;
}

std::optional<ApiError> GetNumberArray(const json& body, const char* name,
                                       std::vector<double>* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  const std::string bad = std::string("'") + name + "' must be an array of numbers";
  if (!it->is_array()) return Bad(bad + ", not " + TypeName(*it), name);
  std::vector<double> v;
  for (const json& e : *it) {
    if (!e.is_number()) return Bad(bad, name);
    v.push_back(e.get<double>());
  }
  *out = std::move(v);
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* name, bool* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return Bad(std::string("'") + name + "' must be a boolean, not " + TypeName(*it), name);
  }
  *out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> GetString(const json& body, const char* name, std::string* out) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) {
    return Bad(std::string("'") + name + "' must be a string, not " + TypeName(*it), name);
  }
  *out = it->get<std::string>();
  return std::nullopt;
}

}  // namespace kdn::router
