/* kdn/client.h is C: this file includes it in a C translation unit (the
 * C API test calls the function below so that the check is linked). */
#include "kdn/client.h"

int kdn_client_header_is_c(void) {
  kdn_kv_layout layout = {0};
  layout.dtype = KDN_BF16;
  return kdn_api_version() == KDN_CLIENT_API_VERSION && layout.k == NULL;
}
