#include "normalize.h"

#include <cstdlib>

#include <utf8proc.h>

#include "utf8.h"

namespace kdn::text {

using nlohmann::json;

namespace {

// `text` in the Unicode normal form `options` asks for (utf8proc_map's
// options); invalid UTF-8 is kept as it is between normalized valid runs.
std::string UnicodeNormalize(std::string_view text, int options) {
  bool ascii = true;
  for (char c : text) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(text);  // every normal form of ASCII is itself
  std::string out;
  out.reserve(text.size());
  size_t run = 0;  // start of the current valid run
  auto flush = [&](size_t end) {
    if (end == run) return;
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(
        reinterpret_cast<const utf8proc_uint8_t*>(text.data() + run),
        static_cast<utf8proc_ssize_t>(end - run), &dst, static_cast<utf8proc_option_t>(options));
    if (n >= 0) {
      out.append(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    } else {
      out.append(text.substr(run, end - run));  // cannot happen on valid UTF-8
    }
    std::free(dst);
  };
  for (size_t i = 0; i < text.size();) {
    const size_t len = CharLength(text, i);
    if (len == 1 && static_cast<unsigned char>(text[i]) >= 0x80) {  // an invalid byte
      flush(i);
      out.push_back(text[i]);
      run = i + 1;
    }
    i += len;
  }
  flush(text.size());
  return out;
}

// A Replace's or Split's "pattern": {"String": s} or {"Regex": r}.
Result<std::unique_ptr<Regex>> Pattern(const json& j, const std::string& where) {
  if (!j.is_object()) return InvalidArgument(where + ".pattern is not an object");
  if (j.contains("String") && j.at("String").is_string()) {
    return Regex::Compile(j.at("String").get<std::string>(), /*literal=*/true, where + ".pattern");
  }
  if (j.contains("Regex") && j.at("Regex").is_string()) {
    return Regex::Compile(j.at("Regex").get<std::string>(), /*literal=*/false, where + ".pattern");
  }
  return InvalidArgument(where + ".pattern has neither a String nor a Regex");
}

}  // namespace

Result<std::unique_ptr<Regex>> PatternFromJson(const json& j, const std::string& where) {
  return Pattern(j, where);
}

Status Normalizer::Add(const json& j, const std::string& where, Normalizer* n) {
  if (j.is_null()) return Status::Ok();
  if (!j.is_object() || !j.contains("type") || !j.at("type").is_string()) {
    return InvalidArgument(where + " has no \"type\"");
  }
  const std::string type = j.at("type").get<std::string>();
  Op op;
  if (type == "Sequence") {
    if (!j.contains("normalizers") || !j.at("normalizers").is_array()) {
      return InvalidArgument(where + ".normalizers is not an array");
    }
    const json& list = j.at("normalizers");
    for (size_t i = 0; i < list.size(); ++i) {
      KDN_RETURN_IF_ERROR(Add(list[i], where + ".normalizers[" + std::to_string(i) + "]", n));
    }
    return Status::Ok();
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    op.kind = Op::kUnicode;
    op.utf8proc_options = UTF8PROC_STABLE | (type[2] == 'C' || type[3] == 'C' ? UTF8PROC_COMPOSE
                                                                              : UTF8PROC_DECOMPOSE);
    if (type.size() == 4) op.utf8proc_options |= UTF8PROC_COMPAT;
  } else if (type == "Prepend") {
    if (!j.contains("prepend") || !j.at("prepend").is_string()) {
      return InvalidArgument(where + ".prepend is not a string");
    }
    op.kind = Op::kPrepend;
    op.text = j.at("prepend").get<std::string>();
  } else if (type == "Replace") {
    if (!j.contains("content") || !j.at("content").is_string()) {
      return InvalidArgument(where + ".content is not a string");
    }
    op.kind = Op::kReplace;
    op.text = j.at("content").get<std::string>();
    if (!j.contains("pattern")) return InvalidArgument(where + " has no pattern");
    KDN_ASSIGN_OR_RETURN(op.pattern, Pattern(j.at("pattern"), where));
  } else {
    return Unimplemented(where + ": the normalizer type \"" + type + "\" is not supported");
  }
  n->ops_.push_back(std::move(op));
  return Status::Ok();
}

Result<std::unique_ptr<Normalizer>> Normalizer::FromJson(const json& j, const std::string& where) {
  auto n = std::make_unique<Normalizer>();
  KDN_RETURN_IF_ERROR(Add(j, where, n.get()));
  return n;
}

std::string Normalizer::Apply(std::string_view text) const {
  std::string s(text);
  for (const Op& op : ops_) {
    switch (op.kind) {
      case Op::kUnicode: s = UnicodeNormalize(s, op.utf8proc_options); break;
      case Op::kPrepend:
        if (!s.empty()) s.insert(0, op.text);  // `tokenizers` leaves an empty text empty
        break;
      case Op::kReplace: {
        const auto matches = op.pattern->FindAll(s);
        if (matches.empty()) break;
        std::string r;
        r.reserve(s.size() + matches.size() * op.text.size());
        size_t at = 0;
        for (const auto& [b, e] : matches) {
          r.append(s, at, b - at);
          r += op.text;
          at = e;
        }
        r.append(s, at, std::string::npos);
        s = std::move(r);
        break;
      }
    }
  }
  return s;
}

}  // namespace kdn::text
