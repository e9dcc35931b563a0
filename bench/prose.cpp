#include "prose.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace kdn::bench {

namespace {

// Paragraphs of one file: runs of non-blank lines, whitespace collapsed.
std::vector<std::string> Paragraphs(const std::string& body) {
  std::vector<std::string> out;
  std::istringstream in(body);
  std::string line, cur;
  auto flush = [&] {
    if (!cur.empty()) out.push_back(cur);
    cur.clear();
  };
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string w;
    bool any = false;
    while (words >> w) {
      if (!cur.empty()) cur += ' ';
      cur += w;
      any = true;
    }
    if (!any) flush();
  }
  flush();
  return out;
}

}  // namespace

Result<Encoder> ProseEncoder(const std::string& model_dir, int vocab,
                             std::unique_ptr<text::Tokenizer>* tok) {
  if (!model_dir.empty()) {
    KDN_ASSIGN_OR_RETURN(*tok, text::Tokenizer::Load(model_dir));
  }
  const text::Tokenizer* t = tok->get();
  return Encoder([t, vocab](const std::string& s) {
    if (t != nullptr) return t->Encode(s, false);
    std::vector<int32_t> ids;
    for (unsigned char ch : s) ids.push_back(static_cast<int32_t>(ch) % vocab);
    return ids;
  });
}

Result<std::vector<ProseDocument>> ProseDocuments(
    const std::string& dir, int min_tokens,
    const std::function<std::vector<int32_t>(const std::string&)>& encode, size_t* nfiles) {
  std::vector<std::filesystem::path> files;
  std::set<std::filesystem::path> seen;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const auto real = std::filesystem::canonical(e.path(), ec);
    if (ec || !std::filesystem::is_regular_file(real) || !seen.insert(real).second) continue;
    files.push_back(e.path());
  }
  if (files.empty()) return NotFound("no text under " + dir + " (scripts/install-deps.sh)");
  std::sort(files.begin(), files.end());
  *nfiles = files.size();
  std::vector<ProseDocument> pool;
  for (size_t f = 0; f < files.size(); ++f) {
    std::ifstream in(files[f]);
    std::stringstream body;
    body << in.rdbuf();
    ProseDocument cur{"", {}, static_cast<int>(f)};
    for (const std::string& para : Paragraphs(body.str())) {
      cur.text += (cur.text.empty() ? "" : "\n") + para;
      cur.tokens = encode(cur.text + "\n\n");
      if (static_cast<int>(cur.tokens.size()) >= min_tokens) {
        if (static_cast<int>(cur.tokens.size()) <= 2 * min_tokens) {
          cur.text += "\n\n";
          pool.push_back(std::move(cur));
        }
        cur = ProseDocument{"", {}, static_cast<int>(f)};
      }
    }
  }
  return pool;
}

std::string KeyWord(const std::string& text) {
  std::string best, w;
  for (size_t i = 0; i <= text.size(); ++i) {
    const char ch = i < text.size() ? text[i] : ' ';
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      w += ch;
    } else {
      if (w.size() > best.size()) best = w;
      w.clear();
    }
  }
  return best;
}

Result<std::vector<std::vector<float>>> TeacherForced(engine::Engine& model,
                                                      engine::KvSequence& seq,
                                                      std::vector<float> logits,
                                                      const std::vector<int32_t>& tokens) {
  std::vector<std::vector<float>> out{std::move(logits)};
  if (tokens.size() < 2) return out;
  std::vector<float> all;
  KDN_RETURN_IF_ERROR(
      model.Prefill(seq, std::span(tokens).first(tokens.size() - 1), {.all_logits = true}, &all));
  const size_t vocab = out[0].size();
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(i * vocab),
                     all.begin() + static_cast<std::ptrdiff_t>((i + 1) * vocab));
  }
  return out;
}

}  // namespace kdn::bench
