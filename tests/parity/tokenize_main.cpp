// Test-only: kdn_tokenize TOKENIZER_DIR
// Loads the tokenizer of TOKENIZER_DIR, then answers one JSON line on stdout
// for each JSON line on stdin, so that one process serves a whole corpus:
//   {"encode": TEXT, "add_bos": BOOL}  ->  {"ids": [...]}
//   {"decode": [IDS]}                  ->  {"text": Decode(ids),
//                                           "stream": the DecodeStream's pieces joined,
//                                           "pieces": [each token's piece, then Finish's]}
// A tokenizer that does not load prints {"error": STATUS} and exits 1.
#include <cstdio>
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "kdn/text/tokenizer.h"

int main(int argc, char** argv) {
  using nlohmann::json;
  if (argc != 2) {
    std::fprintf(stderr, "usage: kdn_tokenize TOKENIZER_DIR < requests.jsonl\n");
    return 2;
  }
  auto tok = kdn::text::Tokenizer::Load(argv[1]);
  if (!tok.ok()) {
    std::cout << json{{"error", tok.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  const kdn::text::Tokenizer& t = **tok;
  std::string line;
  while (std::getline(std::cin, line)) {
    const json req = json::parse(line, nullptr, false);
    json out;
    if (req.is_object() && req.contains("encode") && req.at("encode").is_string()) {
      out["ids"] = t.Encode(req.at("encode").get<std::string>(), req.value("add_bos", false));
    } else if (req.is_object() && req.contains("decode") && req.at("decode").is_array()) {
      const std::vector<int32_t> ids = req.at("decode").get<std::vector<int32_t>>();
      out["text"] = t.Decode(ids);
      auto stream = t.NewDecodeStream();
      std::string joined;
      json pieces = json::array();
      for (int32_t id : ids) {
        pieces.push_back(stream->Next(id));
        joined += pieces.back().get<std::string>();
      }
      pieces.push_back(stream->Finish());
      joined += pieces.back().get<std::string>();
      out["stream"] = joined;
      out["pieces"] = pieces;
    } else {
      out["error"] = "expected {\"encode\": text} or {\"decode\": [ids]}";
    }
    std::cout << out.dump() << '\n' << std::flush;
  }
  return 0;
}
