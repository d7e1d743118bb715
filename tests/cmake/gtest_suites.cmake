# ringlm_add_gtest_suites(TARGET [PROPERTIES name value ...]): one CTest test per GoogleTest suite
# of TARGET, named TARGET.Suite, running `TARGET --gtest_filter=Suite.*`, with the given test
# properties.
#
# Why per suite rather than per test (gtest_discover_tests): a suite's tests then share one
# process, so what its SetUpTestSuite does (load the real model, quantize a file, compile the
# OpenCL kernels) is done once per suite instead of once per test; CTest still runs suites side
# by side (-j) and reports each one. A failure prints the suite's GoogleTest output, which names
# the failing test.
#
# The suites are listed after each build of TARGET (`TARGET --gtest_list_tests`, as
# gtest_discover_tests does) into TARGET_suites.cmake, which CTest reads when it starts.
set(RINGLM_GTEST_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/gtest_suites_list.cmake)

function(ringlm_add_gtest_suites target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "PROPERTIES")
  set(suites_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake)
  set(include_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake)
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D "TEST_EXECUTABLE=$<TARGET_FILE:${target}>" -D "SUITES_FILE=${suites_file}"
            -P ${RINGLM_GTEST_SUITES_SCRIPT}
    BYPRODUCTS ${suites_file}
    VERBATIM)
  set(properties "")
  foreach(p IN LISTS arg_PROPERTIES)
    string(APPEND properties " [==[${p}]==]")
  endforeach()
  file(GENERATE OUTPUT ${include_file} CONTENT
"if(EXISTS [==[${suites_file}]==])
  include([==[${suites_file}]==])  # sets ringlm_suites
  foreach(suite IN LISTS ringlm_suites)
    add_test(\"${target}.\${suite}\" [==[$<TARGET_FILE:${target}>]==] \"--gtest_filter=\${suite}.*\")
    set_tests_properties(\"${target}.\${suite}\" PROPERTIES${properties})
  endforeach()
else()
  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()
