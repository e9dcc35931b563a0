#include "kv_edit_facts.h"

#include <fstream>

namespace kdn::bench {

namespace {

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

// A template with its subject and object in place and "\n" a line break.
std::string Fill(const std::string& t, const std::string& s, const std::string& o) {
  std::string out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t.compare(i, 3, "{s}") == 0) {
      out += s;
      i += 2;
    } else if (t.compare(i, 3, "{o}") == 0) {
      out += o;
      i += 2;
    } else if (t.compare(i, 2, "\\n") == 0) {
      out += '\n';
      i += 1;
    } else {
      out += t[i];
    }
  }
  return out;
}

Result<std::vector<Relation>> ReadFacts(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot read the facts file " + path + " (--facts)");
  std::vector<Relation> rels;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (Trim(line).empty() || line[0] == '#') continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) {
      return InvalidArgument(path + ":" + std::to_string(n) + ": no \"field:\"");
    }
    const std::string field = line.substr(0, colon), value = Trim(line.substr(colon + 1));
    if (field == "relation") {
      rels.push_back({value, "", "", {}, {}});
      continue;
    }
    if (rels.empty()) {
      return InvalidArgument(path + ":" + std::to_string(n) + ": " + field + " before a relation");
    }
    Relation& r = rels.back();
    if (field == "statement") {
      r.statement = value;
    } else if (field == "question") {
      r.question = value;
    } else if (field == "paraphrase") {
      r.paraphrases.push_back(value);
    } else if (field == "fact") {
      const size_t bar = value.find('|');
      if (bar == std::string::npos) {
        return InvalidArgument(path + ":" + std::to_string(n) + ": a fact is \"subject | object\"");
      }
      r.facts.emplace_back(Trim(value.substr(0, bar)), Trim(value.substr(bar + 1)));
    } else {
      return InvalidArgument(path + ":" + std::to_string(n) + ": unknown field " + field);
    }
  }
  for (const Relation& r : rels) {
    if (r.statement.empty() || r.question.empty() || r.paraphrases.size() != 3 ||
        r.facts.size() < 2) {
      return InvalidArgument(path + ": relation " + r.name +
                             " needs a statement, a question, 3 paraphrases and 2 facts");
    }
  }
  return rels;
}

}  // namespace kdn::bench
