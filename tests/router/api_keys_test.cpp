// ApiKeys: the key file's refusals, bearer credentials, and namespaces that
// no tenant and salt can share with another tenant's.
#include "kdn/router/api_keys.h"

#include <gtest/gtest.h>

namespace kdn::router {
namespace {

TEST(ApiKeys, ParsesKeysAndTenantsSkippingCommentsAndBlankLines) {
  auto keys = ApiKeys::Parse(
      "# key tenant\n\nalice-key-0123456789 alice\r\n"
      "  bob-key-9876543210abc   bob  \nalice-key-second-one alice\n",
      "keys");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(keys->size(), 3u);
  EXPECT_EQ(keys->tenants(), 2u);
  const std::string* t = keys->TenantOf("Bearer bob-key-9876543210abc");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(*t, "bob");
  ASSERT_NE(keys->TenantOf("Bearer alice-key-second-one"), nullptr);
  EXPECT_EQ(*keys->TenantOf("Bearer alice-key-second-one"), "alice");
}

TEST(ApiKeys, NamesNoTenantForAnythingButABearerOfAKey) {
  auto keys = ApiKeys::Parse("alice-key-0123456789 alice\n", "keys");
  ASSERT_TRUE(keys.ok());
  for (const char* bad :
       {"", "Bearer ", "alice-key-0123456789", "bearer alice-key-0123456789",
        "Bearer alice-key-012345678", "Bearer alice-key-0123456789 ",
        "Bearer alice-key-01234567890", "Basic YWxpY2U6eA==", "Bearer  alice-key-0123456789"}) {
    EXPECT_EQ(keys->TenantOf(bad), nullptr) << "'" << bad << "'";
  }
  EXPECT_NE(keys->TenantOf("Bearer alice-key-0123456789"), nullptr);
}

// A browser sends the key as the password of Basic credentials (the status
// page asks for them); the user name is not looked at.
TEST(ApiKeys, TakesTheKeyAsTheBasicPasswordOfABrowser) {
  auto keys = ApiKeys::Parse("alice-key-0123456789 alice\n", "keys");
  ASSERT_TRUE(keys.ok());
  for (const char* good : {"Basic YW55b25lOmFsaWNlLWtleS0wMTIzNDU2Nzg5",  // anyone:KEY
                           "Basic OmFsaWNlLWtleS0wMTIzNDU2Nzg5"}) {       // :KEY
    const std::string* t = keys->TenantOf(good);
    ASSERT_NE(t, nullptr) << good;
    EXPECT_EQ(*t, "alice");
  }
  for (const char* bad : {"Basic YWxpY2Uta2V5LTAxMjM0NTY3ODk=",          // KEY, no colon
                          "Basic YW55b25lOmFsaWNlLWtleS0wMTIzNDU2Nzg=",  // a byte short
                          "Basic !!!!", "Basic ", "Basic Ym9iOmFsaWNlLWtleS0wMTIzNDU2Nzg5=x",
                          "basic YW55b25lOmFsaWNlLWtleS0wMTIzNDU2Nzg5"}) {
    EXPECT_EQ(keys->TenantOf(bad), nullptr) << bad;
  }
}

TEST(ApiKeys, RefusesMalformedFilesNamingTheLine) {
  auto expect = [](std::string_view text, const char* words) {
    auto keys = ApiKeys::Parse(text, "f");
    ASSERT_FALSE(keys.ok()) << text;
    EXPECT_EQ(keys.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(keys.status().message().find(words), std::string::npos) << keys.status().message();
  };
  expect("alice-key-0123456789\n", "f:1: a key without a tenant");
  expect("# c\nalice-key-0123456789 alice extra\n", "f:2: expected");
  expect("short alice\n", "at least 16");
  expect("alice-key-0123456789 a\nalice-key-0123456789 b\n", "f:2: a key given twice");
  expect("# only a comment\n\n", "has no key");
  EXPECT_EQ(ApiKeys::Load("/nonexistent/kdn-keys").status().code(), StatusCode::kNotFound);
}

TEST(ApiKeys, NamespacesKeepTenantsApartWhateverTheSalt) {
  const std::string alice = "alice", al = "al", bob = "bob";
  // Without keys the salt is the namespace, as before keys existed.
  EXPECT_EQ(RequestNamespace(nullptr, "s"), "s");
  EXPECT_EQ(RequestNamespace(nullptr, ""), "");
  // A tenant's namespace is neither the keyless one nor another tenant's,
  // with any salt: "al" + "ice:" cannot spell "alice".
  EXPECT_NE(RequestNamespace(&alice, ""), RequestNamespace(nullptr, ""));
  EXPECT_NE(RequestNamespace(&alice, ""), RequestNamespace(&bob, ""));
  EXPECT_NE(RequestNamespace(&al, "ice:"), RequestNamespace(&alice, ""));
  EXPECT_NE(RequestNamespace(&al, "ice"), RequestNamespace(&alice, ""));
  EXPECT_NE(RequestNamespace(&bob, RequestNamespace(&alice, "")), RequestNamespace(&alice, ""));
  // A salt narrows within the tenant.
  EXPECT_NE(RequestNamespace(&alice, "x"), RequestNamespace(&alice, ""));
  EXPECT_EQ(RequestNamespace(&alice, "x"), RequestNamespace(&alice, "x"));
}

}  // namespace
}  // namespace kdn::router
