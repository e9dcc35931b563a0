#pragma once
// Clang's thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html),
// as abseil's base/thread_annotations.h spells them, prefixed KDN_. Clang
// checks them with -Wthread-safety (the clang build of tests/fuzz does, with
// -Werror); other compilers see nothing.
//
//   KDN_GUARDED_BY(mu)      a member read or written only with mu held
//   KDN_PT_GUARDED_BY(mu)   what a pointer member points to, likewise
//   KDN_REQUIRES(mu)        a function called only with mu held
//   KDN_EXCLUDES(mu)        a function called only without mu (it takes it)
//   KDN_ACQUIRE(mu) / KDN_RELEASE(mu)   a function that takes / lets go of mu
//   KDN_CAPABILITY, KDN_SCOPED_CAPABILITY   for lock types (kdn/common/mutex.h)

#if defined(__clang__)
#define KDN_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define KDN_THREAD_ANNOTATION_(x)
#endif

#define KDN_CAPABILITY(name) KDN_THREAD_ANNOTATION_(capability(name))
#define KDN_SCOPED_CAPABILITY KDN_THREAD_ANNOTATION_(scoped_lockable)
#define KDN_GUARDED_BY(x) KDN_THREAD_ANNOTATION_(guarded_by(x))
#define KDN_PT_GUARDED_BY(x) KDN_THREAD_ANNOTATION_(pt_guarded_by(x))
#define KDN_REQUIRES(...) KDN_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define KDN_EXCLUDES(...) KDN_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define KDN_ACQUIRE(...) KDN_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define KDN_RELEASE(...) KDN_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define KDN_ASSERT_CAPABILITY(x) KDN_THREAD_ANNOTATION_(assert_capability(x))
#define KDN_RETURN_CAPABILITY(x) KDN_THREAD_ANNOTATION_(lock_returned(x))
// For the rare function the analysis cannot follow; say why beside it.
#define KDN_NO_THREAD_SAFETY_ANALYSIS KDN_THREAD_ANNOTATION_(no_thread_safety_analysis)
