#pragma once
// A request's documents as openai.cpp reads them (docs/serving.md,
// "Documents", "Editing a document", "Emphasis"): the `documents` field or
// the separator's pieces, their tokens, the blend plan of a prompt made of
// them, and the emphasis on their phrases. Private to router/src.
// Thread-safe (functions over values).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kdn/blend/steering.h"
#include "kdn/router/openai.h"

namespace kdn::router {

// One document of a request or an injection: its text, the erratum stored
// after it (docs/serving.md, "Editing a document"), if any, and the phrases
// of either to emphasize.
struct DocumentText {
  std::string text;
  std::string erratum;
  std::vector<std::string> emphasize;
  // The steered version it names (docs/serving.md, "Steering a document").
  std::optional<blend::SteerSpec> steer;
};

// A `steer` object, {"vector": NAME, "strength": S}: a request's document's
// or an edit's. 400s name `field`'s members.
std::optional<ApiError> ParseSteer(const json& v, const std::string& field, blend::SteerSpec* out);

// A document's tokens, as a request's prompt holds them: the text's, then
// the erratum's, each tokenized on its own. `base`: the text's count when
// there is an erratum, else 0.
std::vector<int32_t> DocumentTokens(const ServedModel& model, const DocumentText& doc,
                                    int64_t* base);

// The `documents` field (set): a non-empty list whose entries are non-empty
// strings or {"text", "erratum", "emphasize", "steer"} objects.
std::optional<ApiError> ParseDocumentsField(const json& body, std::vector<DocumentText>* docs);

// The documents of a request: the `documents` field, or the pieces of `text`
// before the last separator. Sets whether the request has documents; `text`
// keeps what follows them.
std::optional<ApiError> TakeDocuments(const json& body, const std::string& separator,
                                      std::string* text, std::vector<DocumentText>* docs,
                                      bool* has_documents);

// Tokenizes head (after a BOS with `add_bos`), documents and the rest as one
// prompt with a blend plan; the documents' emphasized phrases become the
// plan's emphasis spans, which ParseEmphasis completes.
std::optional<ApiError> BlendPrompt(const ServedModel& model, const std::string& head,
                                    const std::vector<DocumentText>& docs, const std::string& rest,
                                    bool add_bos, const char* param, ApiRequest* out);

// The request's `emphasis`, {"strength": S, "heads": [[layer, head], ...]}
// with both optional (the router's defaults: ServedModel), and its
// documents' phrases (BlendPrompt's spans) made one blend::Emphasis. Set
// with no phrase to emphasize: refused.
std::optional<ApiError> ParseEmphasis(const json& body, const ServedModel& model, ApiRequest* out);

}  // namespace kdn::router
