# Build-time half of gtest_suites.cmake: lists TEST_EXECUTABLE's GoogleTest suites into
# SUITES_FILE as `set(ringlm_suites ...)`. Arguments (-D): TEST_EXECUTABLE, SUITES_FILE.
execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE result TIMEOUT 60)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${TEST_EXECUTABLE} --gtest_list_tests failed (${result}):\n${listing}\n${errors}")
endif()
set(suites "")
string(REPLACE "\n" ";" lines "${listing}")
foreach(line IN LISTS lines)
  # A suite is a line that starts in the first column and ends its name with '.'; its tests are
  # indented under it. (Parameterized suites read "Instance/Suite."; typed ones add a comment.)
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    string(APPEND suites " [==[${CMAKE_MATCH_1}]==]")
  endif()
endforeach()
if(suites STREQUAL "")
  message(FATAL_ERROR "${TEST_EXECUTABLE} lists no test suite:\n${listing}")
endif()
file(WRITE "${SUITES_FILE}" "set(ringlm_suites${suites})\n")
