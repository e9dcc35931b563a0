target_sources(kdn_kvbus_tests PRIVATE ${CMAKE_CURRENT_LIST_DIR}/store_service_test.cpp)
