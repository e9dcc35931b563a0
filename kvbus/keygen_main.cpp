// kdn-keygen: writes a new deployment key for CURVE on kdn's internal
// sockets (kdn/kvbus/curve.h) into a file of mode 0600. Every process of the
// deployment is then started with --curve-keys FILE; kdn-launch does this
// itself in its run folder.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/kvbus/curve.h"

int main(int argc, char** argv) {
  CLI::App app{
      "kdn-keygen: write a new CURVE key for a kdn deployment's internal sockets (mode 0600; "
      "an existing file is never replaced)."};
  std::string path;
  app.add_option("FILE", path, "The key file to create")->required();
  CLI11_PARSE(app, argc, argv);
  auto keys = kdn::kvbus::GenerateCurveKeys();
  kdn::Status st = keys.ok() ? kdn::kvbus::WriteCurveKeys(path, *keys) : keys.status();
  if (!st.ok()) {
    std::fprintf(stderr, "kdn-keygen: %s\n", st.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "kdn-keygen: wrote %s (public key %s)\n", path.c_str(),
               keys->public_key.c_str());
  return 0;
}
