#pragma once
// kdn-bench kv-edit's set (bench/data/kv_edit_facts.txt, --facts): relations,
// each with a statement, a question and three paraphrases as templates
// ("{s}" the subject, "{o}" the object, "\n" a line break), and its facts.

#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::bench {

struct Relation {
  std::string name, statement, question;
  std::vector<std::string> paraphrases;
  std::vector<std::pair<std::string, std::string>> facts;  // subject, object
};

// A template with its subject and object in place and "\n" a line break.
std::string Fill(const std::string& t, const std::string& s, const std::string& o);

// The relations of a facts file; NOT_FOUND when it cannot be read,
// INVALID_ARGUMENT naming the line (path:N) of what is malformed, or the
// relation that lacks a statement, a question, 3 paraphrases or 2 facts.
Result<std::vector<Relation>> ReadFacts(const std::string& path);

}  // namespace kdn::bench
