#include "openai_documents.h"

#include <algorithm>
#include <climits>

#include "json_fields.h"

namespace kdn::router {

std::vector<int32_t> DocumentTokens(const ServedModel& model, const DocumentText& doc,
                                    int64_t* base) {
  std::vector<int32_t> t = model.tokenizer->Encode(doc.text, /*add_bos=*/false);
  *base = 0;
  if (!doc.erratum.empty() && !t.empty()) {
    *base = static_cast<int64_t>(t.size());
    const std::vector<int32_t> note = model.tokenizer->Encode(doc.erratum, /*add_bos=*/false);
    t.insert(t.end(), note.begin(), note.end());
  }
  return t;
}

namespace {

// A document's `emphasize`: a non-empty string, or a non-empty list of them.
std::optional<ApiError> ParseEmphasize(const json& v, const std::string& at,
                                       std::vector<std::string>* out) {
  const std::string field = at + ".emphasize";
  if (v.is_string() && !v.get<std::string>().empty()) {
    out->push_back(v.get<std::string>());
    return std::nullopt;
  }
  if (v.is_array() && !v.empty()) {
    for (const json& p : v) {
      if (!p.is_string() || p.get<std::string>().empty()) break;
      out->push_back(p.get<std::string>());
    }
    if (out->size() == v.size()) return std::nullopt;
  }
  return Bad(field + " must be a phrase of the document, or a list of them (non-empty strings)",
             field);
}

}  // namespace

std::optional<ApiError> ParseSteer(const json& v, const std::string& field, blend::SteerSpec* out) {
  if (!v.is_object()) {
    return Bad(field + " must be {\"vector\": NAME, \"strength\": NUMBER}", field);
  }
  for (const auto& [k, member] : v.items()) {
    if (k != "vector" && k != "strength") {
      return Bad(field + ": unknown field '" + k + "' (vector, strength)", field + "." + k);
    }
  }
  if (!IsSet(v, "vector") || !v["vector"].is_string()) {
    return Bad(field + ".vector must be a steering vector's name", field + ".vector");
  }
  out->vector = v["vector"].get<std::string>();
  if (Status st = blend::CheckSteeringName(out->vector); !st.ok()) {
    return Bad(field + ".vector: " + st.message(), field + ".vector");
  }
  // Checked as the float it travels as: 1e-50 is 0 there.
  const float strength =
      IsSet(v, "strength") && v["strength"].is_number() ? v["strength"].get<float>() : 0.0f;
  if (Status st = blend::CheckSteerStrength(strength); !st.ok()) {
    return Bad(field + ".strength: " + st.message(), field + ".strength");
  }
  out->strength = strength;
  return std::nullopt;
}

std::optional<ApiError> ParseDocumentsField(const json& body, std::vector<DocumentText>* docs) {
  const json& d = body["documents"];
  if (!d.is_array()) {
    return Bad(std::string("'documents' must be a list of strings, not ") + TypeName(d),
               "documents");
  }
  if (d.empty()) return Bad("'documents' is an empty list", "documents");
  for (size_t i = 0; i < d.size(); ++i) {
    const std::string at = "documents[" + std::to_string(i) + "]";
    if (d[i].is_object()) {
      DocumentText doc;
      for (const auto& [k, v] : d[i].items()) {
        if (k == "emphasize") {
          KDN_API_CHECK(ParseEmphasize(v, at, &doc.emphasize));
          continue;
        }
        if (k == "steer") {
          KDN_API_CHECK(ParseSteer(v, at + ".steer", &doc.steer.emplace()));
          continue;
        }
        if (k != "text" && k != "erratum") {
          return Bad(at + ": unknown field '" + k + "' (text, erratum, emphasize, steer)",
                     at + "." + k);
        }
        if (!v.is_string() || v.get<std::string>().empty()) {
          return Bad(at + "." + k + " must be a non-empty string", at + "." + k);
        }
        (k == "text" ? doc.text : doc.erratum) = v.get<std::string>();
      }
      if (doc.text.empty()) return Bad(at + ".text is required", at + ".text");
      if (doc.steer && !doc.erratum.empty()) {
        return Bad(at + ": a steered version is of a document without an erratum", at + ".steer");
      }
      docs->push_back(std::move(doc));
      continue;
    }
    if (!d[i].is_string() || d[i].get<std::string>().empty()) {
      return Bad(at + " must be a non-empty string or {\"text\", \"erratum\"}", "documents");
    }
    docs->push_back({d[i].get<std::string>(), {}});
  }
  return std::nullopt;
}

std::optional<ApiError> TakeDocuments(const json& body, const std::string& separator,
                                      std::string* text, std::vector<DocumentText>* docs,
                                      bool* has_documents) {
  *has_documents = false;
  if (IsSet(body, "documents")) {
    KDN_API_CHECK(ParseDocumentsField(body, docs));
    *has_documents = true;
    return std::nullopt;
  }
  if (separator.empty() || text->find(separator) == std::string::npos) return std::nullopt;
  size_t from = 0;
  for (size_t at; (at = text->find(separator, from)) != std::string::npos;
       from = at + separator.size()) {
    if (at > from) docs->push_back({text->substr(from, at - from), {}});
  }
  *text = text->substr(from);
  *has_documents = !docs->empty();
  return std::nullopt;
}

std::optional<ApiError> BlendPrompt(const ServedModel& model, const std::string& head,
                                    const std::vector<DocumentText>& docs, const std::string& rest,
                                    bool add_bos, const char* param, ApiRequest* out) {
  BlendSpec b;
  out->prompt = model.tokenizer->Encode(head, add_bos);
  b.head_tokens = static_cast<int>(out->prompt.size());
  for (size_t i = 0; i < docs.size(); ++i) {
    int64_t base = 0;
    std::vector<int32_t> t = DocumentTokens(model, docs[i], &base);
    if (t.empty()) {
      return Bad("document " + std::to_string(i) + " has no tokens", "documents");
    }
    b.segment_tokens.push_back(static_cast<int>(t.size()));
    if (docs[i].steer) {
      // One per document once any names a steered version.
      b.steer.resize(docs.size());
      b.steer[i] = docs[i].steer;
    }
    // Its emphasized phrases, as prompt positions: the request's
    // 'emphasis' gives the heads and the strength (ParseEmphasis).
    for (const std::string& phrase : docs[i].emphasize) {
      const auto held = text::TokensHolding(*model.tokenizer, t, phrase);
      if (!held) {
        const std::string field = "documents[" + std::to_string(i) + "].emphasize";
        return Bad(field + ": '" + phrase + "' is not in the document", field);
      }
      if (!b.emphasis) b.emphasis.emplace();
      const auto at = static_cast<int64_t>(out->prompt.size());
      b.emphasis->spans.emplace_back(at + held->first, at + held->second);
    }
    out->prompt.insert(out->prompt.end(), t.begin(), t.end());
  }
  std::vector<int32_t> t = model.tokenizer->Encode(rest, /*add_bos=*/false);
  if (t.empty()) {
    return Bad(std::string("the text after the documents (the question) is empty"), param);
  }
  out->prompt.insert(out->prompt.end(), t.begin(), t.end());
  out->blend = std::move(b);
  return std::nullopt;
}

std::optional<ApiError> ParseEmphasis(const json& body, const ServedModel& model, ApiRequest* out) {
  const bool phrases = out->blend && out->blend->emphasis;
  if (IsSet(body, "emphasis") && !phrases) {
    return Bad("'emphasis' needs a document with phrases to emphasize (documents[i].emphasize)",
               "emphasis");
  }
  if (!phrases) return std::nullopt;
  double strength = model.emphasis_strength;
  std::vector<blend::EmphasisHead> heads = model.emphasis_heads;
  if (heads.empty())
    heads = blend::MiddleThirdHeads(model.config->num_layers, model.config->num_heads);
  if (IsSet(body, "emphasis")) {
    const json& e = body["emphasis"];
    if (!e.is_object()) {
      return Bad("'emphasis' must be an object: {\"strength\", \"heads\"}", "emphasis");
    }
    for (const auto& [k, v] : e.items()) {
      const std::string field = "emphasis." + k;
      if (k == "strength") {
        if (!v.is_number()) return Bad("'" + field + "' must be a number", field);
        strength = v.get<double>();
        if (Status st = blend::CheckEmphasisStrength(strength); !st.ok()) {
          return Bad("'" + field + "': " + st.message(), field);
        }
      } else if (k == "heads") {
        heads.clear();
        const auto small = [](const json& n) {
          return n.is_number_integer() && n.get<int64_t>() >= INT32_MIN &&
                 n.get<int64_t>() <= INT32_MAX;
        };
        const bool pairs = v.is_array() && std::all_of(v.begin(), v.end(), [&](const json& h) {
                             return h.is_array() && h.size() == 2 && small(h[0]) && small(h[1]);
                           });
        if (!pairs) {
          return Bad("'" + field + "' must be a list of [layer, head] pairs of integers", field);
        }
        for (const json& h : v) heads.push_back({h[0].get<int>(), h[1].get<int>()});
        if (Status st =
                blend::CheckEmphasisHeads(heads, model.config->num_layers, model.config->num_heads);
            !st.ok()) {
          return Bad("'" + field + "': " + st.message(), field);
        }
      } else {
        return Bad("'emphasis': unknown field '" + k + "' (strength, heads)", field);
      }
    }
  }
  out->blend->emphasis =
      blend::MakeEmphasis(std::move(out->blend->emphasis->spans), heads, strength,
                          model.config->num_layers, model.config->num_heads);
  return std::nullopt;
}

}  // namespace kdn::router
