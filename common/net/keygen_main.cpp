// kdn-keygen: writes new CURVE keys for a kdn deployment's internal sockets
// (kdn/net/curve.h) into files of mode 0600: the members' key (workers and
// kdn-store take it with --curve-keys) and, with --router, the router's (the
// router takes it; the workers' control sockets then admit the router
// alone). kdn-launch does this itself in its run folder.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/net/curve.h"

int main(int argc, char** argv) {
  CLI::App app{
      "kdn-keygen: write new CURVE keys for a kdn deployment's internal sockets (mode 0600; an "
      "existing file is never replaced)."};
  std::string path, router_path;
  app.add_option("FILE", path,
                 "The members' key file to create, for kdn-prefill, kdn-decode and kdn-store "
                 "(--curve-keys)")
      ->required();
  app.add_option("--router", router_path,
                 "Also create the router's key file here, for kdn-router --curve-keys; the "
                 "workers' control sockets then admit the router alone. Without it, FILE is one "
                 "key for every process, the router included");
  CLI11_PARSE(app, argc, argv);
  using kdn::net::CurveKeys;
  kdn::Status st;
  std::string public_key;
  if (router_path.empty()) {
    auto keys = kdn::net::GenerateCurveKeys();
    st = keys.ok() ? kdn::net::WriteCurveKeys(path, *keys) : keys.status();
    if (keys.ok()) public_key = keys->public_key;
  } else {
    auto keys = kdn::net::GenerateDeploymentKeys();
    st = keys.ok() ? kdn::net::WriteCurveKeys(path, keys->first) : keys.status();
    if (st.ok()) {
      st = kdn::net::WriteCurveKeys(router_path, keys->second);
      if (!st.ok()) std::remove(path.c_str());  // both or neither
    }
    if (keys.ok()) public_key = keys->first.public_key;
  }
  if (!st.ok()) {
    std::fprintf(stderr, "kdn-keygen: %s\n", st.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "kdn-keygen: wrote %s%s (members' public key %s)\n", path.c_str(),
               router_path.empty() ? "" : (" and " + router_path).c_str(), public_key.c_str());
  return 0;
}
