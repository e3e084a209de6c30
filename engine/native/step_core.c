/* The engine step's per-row loops, compiled: each function is called once per step and
 * walks every row of the batch (engine/native/__init__.py says which Python code calls
 * which, and why these loops).
 *
 * Built against CPython's stable ABI (Py_LIMITED_API 3.11): one binary serves Python 3.11
 * and every later version. The functions work on the engine's own Python objects (requests,
 * chunks, tracked requests) through their attributes: the objects stay the one record of a
 * request's state, and only the interpreter's per-row cost goes. Each function keeps the
 * semantics of the Python loop it replaced, checks included (the same exceptions, raised
 * before anything is changed where the Python code validated first).
 *
 * Reference counting: every PyObject* obtained here is a new reference unless noted
 * "borrowed"; each is released on every path (the `fail` labels).
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Interned attribute names, created once at import (module_exec). */
static PyObject *s_status, *s_request_id, *s_num_computed_tokens, *s_output_token_ids,
    *s_prompt_token_ids, *s_block_ids, *s_num_steps, *s_sampling_params, *s_max_tokens,
    *s_mode, *s_stop, *s_stop_token_ids, *s_text, *s_num_emitted_chars, *s_detokenizer,
    *s_holding, *s_finished, *s_texts, *s_add, *s_budget, *s_chunks, *s_request,
    *s_num_cached_tokens, *s_empty, *s_zero;

/* A chunk is a ScheduledChunk: a tuple (request_id, token_ids, start_pos, block_ids, sample). */
enum { CHUNK_REQUEST_ID = 0, CHUNK_TOKEN_IDS = 1, CHUNK_START_POS = 2, CHUNK_BLOCK_IDS = 3,
       CHUNK_SAMPLE = 4, CHUNK_FIELDS = 5 };

static long get_long_attr(PyObject *obj, PyObject *name, int *ok) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) { *ok = 0; return -1; }
    long result = PyLong_AsLong(value);
    Py_DECREF(value);
    if (result == -1 && PyErr_Occurred()) *ok = 0;
    return result;
}

static int set_long_attr(PyObject *obj, PyObject *name, long value) {
    PyObject *boxed = PyLong_FromLong(value);
    if (boxed == NULL) return -1;
    int rc = PyObject_SetAttr(obj, name, boxed);
    Py_DECREF(boxed);
    return rc;
}

/* A writable, C-contiguous int32 buffer of at least `needed` items. */
static int int32_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t needed, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *format = view->format;
    if (format != NULL && (*format == '@' || *format == '=' || *format == '<'))
        format++;  /* native or little-endian order: x86-64's */
    if (view->itemsize != 4 || format == NULL || *format == 0 || strchr("iIl", *format) == NULL
            || format[1] != 0) {
        PyErr_Format(PyExc_TypeError, "%s: an int32 buffer is needed", what);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len / 4 < needed) {
        PyErr_Format(PyExc_ValueError, "%s: %zd items needed, the buffer holds %zd", what,
                     needed, view->len / 4);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---- the scheduler: a step's decode rows --------------------------------------------------- */

PyDoc_STRVAR(schedule_decodes_doc,
"schedule_decodes(seated, loading, step, block_size, running, chunk_type, tuple_new,\n"
"                 schedule_running) -> list of requests with prompt tokens left\n\n"
"Scheduler.schedule()'s rule 2 over the seated requests, in order: a RUNNING request not\n"
"reloading (`loading`) with one token to compute gets its decode chunk in step.chunks while\n"
"step.budget lasts; one whose slot needs a new block goes through `schedule_running(request)`\n"
"(which may preempt); one with more tokens left is returned, in order, for rule 3.");

static PyObject *schedule_decodes(PyObject *self, PyObject *args) {
    PyObject *seated, *loading, *step, *running, *chunk_type, *tuple_new, *schedule_running;
    long block_size;
    if (!PyArg_ParseTuple(args, "OOOlOOOO", &seated, &loading, &step, &block_size, &running,
                          &chunk_type, &tuple_new, &schedule_running))
        return NULL;
    int check_loading = PyObject_IsTrue(loading);
    if (check_loading < 0) return NULL;
    int ok = 1;
    long budget = get_long_attr(step, s_budget, &ok);
    if (!ok) return NULL;
    PyObject *chunks = PyObject_GetAttr(step, s_chunks);
    if (chunks == NULL) return NULL;
    PyObject *prefills = PyList_New(0);
    PyObject *iter = PyObject_GetIter(seated);
    PyObject *request = NULL, *status = NULL, *rid = NULL, *start_obj = NULL, *output = NULL,
        *prompt = NULL, *block_ids = NULL;
    if (prefills == NULL || iter == NULL) goto fail;
    while ((request = PyIter_Next(iter)) != NULL) {
        status = PyObject_GetAttr(request, s_status);
        if (status == NULL) goto fail;
        if (status != running) goto next;
        rid = PyObject_GetAttr(request, s_request_id);
        if (rid == NULL) goto fail;
        if (check_loading) {
            int loading_it = PySequence_Contains(loading, rid);
            if (loading_it < 0) goto fail;
            if (loading_it) goto next;
        }
        start_obj = PyObject_GetAttr(request, s_num_computed_tokens);
        output = PyObject_GetAttr(request, s_output_token_ids);
        prompt = PyObject_GetAttr(request, s_prompt_token_ids);
        if (start_obj == NULL || output == NULL || prompt == NULL) goto fail;
        long start = PyLong_AsLong(start_obj);
        Py_ssize_t num_output = PyObject_Length(output), num_prompt = PyObject_Length(prompt);
        if ((start == -1 && PyErr_Occurred()) || num_output < 0 || num_prompt < 0) goto fail;
        if (num_prompt + num_output - start != 1) {
            if (PyList_Append(prefills, request) < 0) goto fail;
            goto next;
        }
        if (budget <= 0) goto next;
        block_ids = PyObject_GetAttr(request, s_block_ids);
        if (block_ids == NULL) goto fail;
        Py_ssize_t num_blocks = PyObject_Length(block_ids);
        if (num_blocks < 0) goto fail;
        if (start < (long)num_blocks * block_size) {
            /* Its slot is in its table already: the last output (or prompt) token, sampled. */
            PyObject *token = num_output ? PySequence_GetItem(output, num_output - 1)
                                         : PySequence_GetItem(prompt, num_prompt - 1);
            if (token == NULL) goto fail;
            PyObject *token_ids = PyTuple_Pack(1, token);
            Py_DECREF(token);
            if (token_ids == NULL) goto fail;
            PyObject *fields = PyTuple_Pack(CHUNK_FIELDS, rid, token_ids, start_obj, block_ids,
                                            Py_True);
            Py_DECREF(token_ids);
            if (fields == NULL) goto fail;
            PyObject *chunk = PyObject_CallFunctionObjArgs(tuple_new, chunk_type, fields, NULL);
            Py_DECREF(fields);
            if (chunk == NULL) goto fail;
            int rc = PyDict_SetItem(chunks, rid, chunk);
            Py_DECREF(chunk);
            if (rc < 0) goto fail;
            budget -= 1;
        } else {
            /* A new block first (possibly preempting): the Python rule, the budget shared. */
            if (set_long_attr(step, s_budget, budget) < 0) goto fail;
            PyObject *done = PyObject_CallFunctionObjArgs(schedule_running, request, NULL);
            if (done == NULL) goto fail;
            Py_DECREF(done);
            budget = get_long_attr(step, s_budget, &ok);
            if (!ok) goto fail;
        }
    next:
        Py_CLEAR(status); Py_CLEAR(rid); Py_CLEAR(start_obj); Py_CLEAR(output);
        Py_CLEAR(prompt); Py_CLEAR(block_ids); Py_CLEAR(request);
    }
    if (PyErr_Occurred()) goto fail;
    Py_DECREF(iter);
    Py_DECREF(chunks);
    if (set_long_attr(step, s_budget, budget) < 0) { Py_DECREF(prefills); return NULL; }
    return prefills;
fail:
    Py_XDECREF(status); Py_XDECREF(rid); Py_XDECREF(start_obj); Py_XDECREF(output);
    Py_XDECREF(prompt); Py_XDECREF(block_ids); Py_XDECREF(request);
    Py_XDECREF(iter); Py_XDECREF(prefills); Py_DECREF(chunks);
    return NULL;
}

/* ---- the scheduler: a step applied ------------------------------------------------------- */

PyDoc_STRVAR(advance_chunks_doc,
"advance_chunks(chunks, scheduled, requests, running, sampled, placeholder, block_size,\n"
"               cache_full_blocks, after_sample, prefill_only, parks) -> missing ids\n\n"
"Scheduler.update_from_output()'s loop. The live chunks are those whose request (as\n"
"`scheduled`) is still RUNNING and still the one `requests` holds. With `sampled` (a dict)\n"
"every live sampling chunk needs a token: the ids without one are returned, nothing\n"
"changed. Else (an empty list returned) each live chunk's request advances past the chunk,\n"
"counts a step, publishes blocks it filled (`cache_full_blocks`), and a sampling chunk\n"
"appends its token (`placeholder` when `sampled` is None), then `after_sample(request)`\n"
"where its mode is `prefill_only`, the scheduler `parks`, or max_tokens is reached.");

static PyObject *advance_chunks(PyObject *self, PyObject *args) {
    PyObject *chunks, *scheduled, *requests, *running, *sampled, *placeholder, *cache_full_blocks,
        *after_sample, *prefill_only;
    long block_size;
    int parks;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOlOOOp", &PyTuple_Type, &chunks, &PyDict_Type,
                          &scheduled, &PyDict_Type, &requests, &running, &sampled, &placeholder,
                          &block_size, &cache_full_blocks, &after_sample, &prefill_only, &parks))
        return NULL;
    Py_ssize_t n = PyTuple_Size(chunks);
    /* live[i]: the request of chunk i (borrowed from `scheduled`), NULL where not live. */
    PyObject **live = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    PyObject *missing = PyList_New(0), *result = NULL;
    if (live == NULL || missing == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *chunk = PyTuple_GetItem(chunks, i);  /* borrowed */
        PyObject *rid = chunk ? PyTuple_GetItem(chunk, CHUNK_REQUEST_ID) : NULL;
        if (rid == NULL) goto done;
        PyObject *request = PyDict_GetItemWithError(scheduled, rid);  /* borrowed */
        if (request == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, rid);
            goto done;
        }
        PyObject *status = PyObject_GetAttr(request, s_status);
        if (status == NULL) goto done;
        Py_DECREF(status);  /* identity only: the enum member outlives this */
        if (status != running) continue;
        PyObject *held = PyDict_GetItemWithError(requests, rid);  /* borrowed */
        if (held == NULL && PyErr_Occurred()) goto done;
        if (held != request) continue;
        live[i] = request;
        if (sampled != Py_None && PyObject_IsTrue(PyTuple_GetItem(chunk, CHUNK_SAMPLE)) == 1) {
            int has = PySequence_Contains(sampled, rid);
            if (has < 0) goto done;
            if (!has && PyList_Append(missing, rid) < 0) goto done;
        }
    }
    if (PyList_Size(missing)) { result = missing; missing = NULL; goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *request = live[i];
        if (request == NULL) continue;
        Py_INCREF(request);  /* a callback may drop the dicts' references */
        PyObject *chunk = PyTuple_GetItem(chunks, i);
        PyObject *output = NULL, *params = NULL, *token = NULL, *mode = NULL;
        int ok = 1;
        long start = PyLong_AsLong(PyTuple_GetItem(chunk, CHUNK_START_POS));
        Py_ssize_t num_new = PyObject_Length(PyTuple_GetItem(chunk, CHUNK_TOKEN_IDS));
        long computed = get_long_attr(request, s_num_computed_tokens, &ok);
        long steps = ok ? get_long_attr(request, s_num_steps, &ok) : 0;
        if (!ok || num_new < 0 || (start == -1 && PyErr_Occurred())) goto row_fail;
        if (start != computed) {  /* set by schedule(), unmoved since */
            PyErr_Format(PyExc_AssertionError, "a chunk starts at %ld, its request has "
                         "computed %ld tokens", start, computed);
            goto row_fail;
        }
        long end = start + (long)num_new;
        if (set_long_attr(request, s_num_computed_tokens, end) < 0
                || set_long_attr(request, s_num_steps, steps + 1) < 0)
            goto row_fail;
        /* Blocks publish once full: a chunk completing none has none to publish. */
        if (end / block_size != start / block_size) {
            PyObject *r = PyObject_CallFunctionObjArgs(cache_full_blocks, request, NULL);
            if (r == NULL) goto row_fail;
            Py_DECREF(r);
        }
        int sample = PyObject_IsTrue(PyTuple_GetItem(chunk, CHUNK_SAMPLE));
        if (sample < 0) goto row_fail;
        if (sample) {
            output = PyObject_GetAttr(request, s_output_token_ids);
            if (output == NULL) goto row_fail;
            if (sampled == Py_None) {
                token = placeholder; Py_INCREF(token);
            } else {
                PyObject *raw = PyObject_GetItem(sampled, PyTuple_GetItem(chunk, CHUNK_REQUEST_ID));
                if (raw == NULL) goto row_fail;
                token = PyNumber_Long(raw);
                Py_DECREF(raw);
                if (token == NULL) goto row_fail;
            }
            if (PyList_Append(output, token) < 0) goto row_fail;
            mode = PyObject_GetAttr(request, s_mode);
            if (mode == NULL) goto row_fail;
            int after = mode == prefill_only || parks;
            if (!after) {
                params = PyObject_GetAttr(request, s_sampling_params);
                long max_tokens = params ? get_long_attr(params, s_max_tokens, &ok) : 0;
                if (params == NULL || !ok) goto row_fail;
                after = PyList_Size(output) >= max_tokens;
            }
            if (after) {
                PyObject *r = PyObject_CallFunctionObjArgs(after_sample, request, NULL);
                if (r == NULL) goto row_fail;
                Py_DECREF(r);
            }
        }
        Py_XDECREF(output); Py_XDECREF(params); Py_XDECREF(token); Py_XDECREF(mode);
        Py_DECREF(request);
        continue;
    row_fail:
        Py_XDECREF(output); Py_XDECREF(params); Py_XDECREF(token); Py_XDECREF(mode);
        Py_DECREF(request);
        goto done;
    }
    result = missing; missing = NULL;
done:
    PyMem_Free(live);
    Py_XDECREF(missing);
    return result;
}

/* ---- the overlapped step's tokens: resolved and postprocessed ---------------------------- */

PyDoc_STRVAR(resolve_rows_doc,
"resolve_rows(rows, token_ids, logprobs, tracked_by_id, running, output_type, postprocess,\n"
"             fast_detokenizer, placeholder) -> list of outputs\n\n"
"LLMEngine._resolve and OutputProcessor.process_resolved in one call. First every row's\n"
"token replaces its request's PLACEHOLDER (AssertionError where none is pending); then, in\n"
"row order, rows no longer tracked are skipped, a row that may end its request goes through\n"
"`postprocess(tracked, token, logprobs)`, and the common row (RUNNING, no stop strings,\n"
"neither a stop token nor max_tokens) makes its output here: its detokenizer's text (a\n"
"`fast_detokenizer` not holding bytes: its `_texts` table; any other: `add`), all of it\n"
"emitted, none kept.");

static PyObject *detokenize(PyObject *detokenizer, PyObject *fast_type, PyObject *token) {
    if ((PyObject *)Py_TYPE(detokenizer) == fast_type) {
        PyObject *holding = PyObject_GetAttr(detokenizer, s_holding);
        PyObject *finished = holding ? PyObject_GetAttr(detokenizer, s_finished) : NULL;
        int fast = holding && finished && holding == Py_False && finished == Py_False;
        Py_XDECREF(holding);
        Py_XDECREF(finished);
        if (holding == NULL || finished == NULL) return NULL;
        if (fast) {
            PyObject *texts = PyObject_GetAttr(detokenizer, s_texts);
            if (texts == NULL) return NULL;
            long id = PyLong_AsLong(token);
            Py_ssize_t size = PyObject_Length(texts);
            if ((id == -1 && PyErr_Occurred()) || size < 0) { Py_DECREF(texts); return NULL; }
            if (id >= 0 && id < size) {
                PyObject *text = PySequence_GetItem(texts, id);
                Py_DECREF(texts);
                if (text == NULL || text != Py_None) return text;
                Py_DECREF(text);
            } else {
                Py_DECREF(texts);
            }
        }
    }
    return PyObject_CallMethodObjArgs(detokenizer, s_add, token, NULL);
}

static PyObject *resolve_rows(PyObject *self, PyObject *args) {
    PyObject *rows, *token_ids, *logprobs, *tracked_by_id, *running, *output_type, *postprocess,
        *fast_type, *placeholder;
    if (!PyArg_ParseTuple(args, "OOOO!OOOOO", &rows, &token_ids, &logprobs, &PyDict_Type,
                          &tracked_by_id, &running, &output_type, &postprocess, &fast_type,
                          &placeholder))
        return NULL;
    Py_ssize_t n = PyObject_Length(rows);
    if (n < 0) return NULL;
    if (PyObject_Length(token_ids) != n || PyObject_Length(logprobs) != n) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "rows, token ids and logprobs differ in length");
        return NULL;
    }
    /* 1. Every PLACEHOLDER gets its token (whatever the request's state since). */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *tracked = PySequence_GetItem(rows, i);
        PyObject *request = tracked ? PyObject_GetAttr(tracked, s_request) : NULL;
        PyObject *output = request ? PyObject_GetAttr(request, s_output_token_ids) : NULL;
        PyObject *token = output ? PySequence_GetItem(token_ids, i) : NULL;
        int rc = -1;
        if (token != NULL) {
            Py_ssize_t len = PyList_Size(output);
            PyObject *last = len > 0 ? PyList_GetItem(output, len - 1) : NULL;  /* borrowed */
            int pending = last ? PyObject_RichCompareBool(last, placeholder, Py_EQ) : 0;
            if (pending == 1) {
                Py_INCREF(token);
                rc = PyList_SetItem(output, len - 1, token);  /* steals the reference */
            } else if (pending == 0) {
                PyObject *rid = PyObject_GetAttr(request, s_request_id);
                PyErr_Format(PyExc_AssertionError, "%R has no token pending", rid);
                Py_XDECREF(rid);
            }
        }
        Py_XDECREF(token); Py_XDECREF(output); Py_XDECREF(request); Py_XDECREF(tracked);
        if (rc < 0) return NULL;
    }
    /* 2. The outputs. */
    PyObject *outputs = PyList_New(0);
    if (outputs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *tracked = NULL, *request = NULL, *rid = NULL, *params = NULL, *output = NULL,
            *token = NULL, *lp = NULL, *status = NULL, *stop = NULL, *stop_ids = NULL,
            *detokenizer = NULL, *delta = NULL, *text = NULL, *new_text = NULL, *prompt = NULL,
            *cached = NULL, *steps = NULL, *out = NULL, *ids_list = NULL, *lp_list = NULL,
            *num_output_obj = NULL, *num_prompt_obj = NULL;
        int ok = 1, failed = 0;
        tracked = PySequence_GetItem(rows, i);
        request = tracked ? PyObject_GetAttr(tracked, s_request) : NULL;
        rid = request ? PyObject_GetAttr(request, s_request_id) : NULL;
        if (rid == NULL) goto row_fail;
        PyObject *held = PyDict_GetItemWithError(tracked_by_id, rid);  /* borrowed */
        if (held == NULL && PyErr_Occurred()) goto row_fail;
        if (held != tracked) goto row_done;  /* aborted (or untracked) since it was planned */
        params = PyObject_GetAttr(request, s_sampling_params);
        output = params ? PyObject_GetAttr(request, s_output_token_ids) : NULL;
        token = output ? PySequence_GetItem(token_ids, i) : NULL;
        lp = token ? PySequence_GetItem(logprobs, i) : NULL;
        status = lp ? PyObject_GetAttr(request, s_status) : NULL;
        stop = status ? PyObject_GetAttr(params, s_stop) : NULL;
        stop_ids = stop ? PyObject_GetAttr(tracked, s_stop_token_ids) : NULL;
        if (stop_ids == NULL) goto row_fail;
        Py_ssize_t num_output = PyList_Size(output);
        long max_tokens = get_long_attr(params, s_max_tokens, &ok);
        int has_stop = PyObject_IsTrue(stop);
        int is_stop_token = has_stop == 0 ? PySequence_Contains(stop_ids, token) : 0;
        if (!ok || num_output < 0 || has_stop < 0 || is_stop_token < 0) goto row_fail;
        if (status != running || has_stop || is_stop_token || num_output >= max_tokens) {
            out = PyObject_CallFunctionObjArgs(postprocess, tracked, token, lp, NULL);
            if (out == NULL) goto row_fail;
        } else {
            /* `_emit` without stop strings: all the text goes out, none is kept. */
            detokenizer = PyObject_GetAttr(tracked, s_detokenizer);
            delta = detokenizer ? detokenize(detokenizer, fast_type, token) : NULL;
            text = delta ? PyObject_GetAttr(tracked, s_text) : NULL;
            long emitted = text ? get_long_attr(tracked, s_num_emitted_chars, &ok) : 0;
            if (text == NULL || !ok) goto row_fail;
            if (emitted == 0 && PyUnicode_GetLength(text) == 0) {
                new_text = delta; Py_INCREF(new_text);
            } else {
                PyObject *whole = PyUnicode_Concat(text, delta);
                if (whole == NULL) goto row_fail;
                new_text = PyUnicode_Substring(whole, emitted, PyUnicode_GetLength(whole));
                Py_DECREF(whole);
                if (new_text == NULL) goto row_fail;
            }
            if (PyObject_SetAttr(tracked, s_text, s_empty) < 0
                    || PyObject_SetAttr(tracked, s_num_emitted_chars, s_zero) < 0)
                goto row_fail;
            prompt = PyObject_GetAttr(request, s_prompt_token_ids);
            cached = prompt ? PyObject_GetAttr(request, s_num_cached_tokens) : NULL;
            steps = cached ? PyObject_GetAttr(request, s_num_steps) : NULL;
            ids_list = steps ? PyList_New(1) : NULL;
            lp_list = ids_list ? PyList_New(1) : NULL;
            if (lp_list == NULL) goto row_fail;
            Py_INCREF(token); PyList_SetItem(ids_list, 0, token);
            Py_INCREF(lp); PyList_SetItem(lp_list, 0, lp);
            Py_ssize_t num_prompt = PyObject_Length(prompt);
            if (num_prompt < 0) goto row_fail;
            num_prompt_obj = PyLong_FromSsize_t(num_prompt);
            num_output_obj = num_prompt_obj ? PyLong_FromSsize_t(num_output) : NULL;
            if (num_output_obj == NULL) goto row_fail;
            out = PyObject_CallFunctionObjArgs(output_type, rid, ids_list, new_text, lp_list,
                                               Py_None, num_prompt_obj, num_output_obj, cached,
                                               Py_False, steps, NULL);
            if (out == NULL) goto row_fail;
        }
        if (PyList_Append(outputs, out) < 0) goto row_fail;
        goto row_done;
    row_fail:
        failed = 1;
    row_done:
        Py_XDECREF(tracked); Py_XDECREF(request); Py_XDECREF(rid); Py_XDECREF(params);
        Py_XDECREF(output); Py_XDECREF(token); Py_XDECREF(lp); Py_XDECREF(status);
        Py_XDECREF(stop); Py_XDECREF(stop_ids); Py_XDECREF(detokenizer); Py_XDECREF(delta);
        Py_XDECREF(text); Py_XDECREF(new_text); Py_XDECREF(prompt); Py_XDECREF(cached);
        Py_XDECREF(steps); Py_XDECREF(out); Py_XDECREF(ids_list); Py_XDECREF(lp_list);
        Py_XDECREF(num_output_obj); Py_XDECREF(num_prompt_obj);
        if (failed) {
            Py_DECREF(outputs);
            return NULL;
        }
    }
    return outputs;
}

/* ---- the runner: a step's inputs --------------------------------------------------------- */

PyDoc_STRVAR(placeholder_sources_doc,
"placeholder_sources(chunks, previous_rows, placeholder) -> (dst, src)\n\n"
"model_runner.placeholder_sources: the flat token positions of every PLACEHOLDER and the\n"
"rows of the previous step (`previous_rows`: request id -> row, or None) they read.");

static PyObject *placeholder_sources(PyObject *self, PyObject *args) {
    PyObject *chunks, *previous_rows, *placeholder;
    if (!PyArg_ParseTuple(args, "O!OO", &PyTuple_Type, &chunks, &previous_rows, &placeholder))
        return NULL;
    PyObject *dst = PyList_New(0), *src = PyList_New(0);
    if (dst == NULL || src == NULL) goto fail;
    Py_ssize_t n = PyTuple_Size(chunks), offset = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *chunk = PyTuple_GetItem(chunks, i);  /* borrowed */
        PyObject *token_ids = chunk ? PyTuple_GetItem(chunk, CHUNK_TOKEN_IDS) : NULL;
        Py_ssize_t len = token_ids ? PyTuple_Size(token_ids) : -1;
        if (len < 1) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a chunk without tokens");
            goto fail;
        }
        PyObject *last = PyTuple_GetItem(token_ids, len - 1);  /* borrowed */
        int is_placeholder = PyObject_RichCompareBool(last, placeholder, Py_EQ);
        if (is_placeholder < 0) goto fail;
        if (is_placeholder) {
            PyObject *rid = PyTuple_GetItem(chunk, CHUNK_REQUEST_ID);
            if (len != 1 || previous_rows == Py_None) {
                PyErr_Format(PyExc_AssertionError, "%U: a PLACEHOLDER outside a decode chunk, "
                             "or without the previous step's tokens", rid);
                goto fail;
            }
            PyObject *row = PyObject_GetItem(previous_rows, rid);
            PyObject *position = row ? PyLong_FromSsize_t(offset) : NULL;
            int rc = position ? PyList_Append(dst, position) : -1;
            if (rc == 0) rc = PyList_Append(src, row);
            Py_XDECREF(row);
            Py_XDECREF(position);
            if (rc < 0) goto fail;
        }
        offset += len;
    }
    PyObject *result = PyTuple_Pack(2, dst, src);
    Py_DECREF(dst);
    Py_DECREF(src);
    return result;
fail:
    Py_XDECREF(dst);
    Py_XDECREF(src);
    return NULL;
}

PyDoc_STRVAR(fill_decode_rows_doc,
"fill_decode_rows(chunks, count, block_size, input_ids, positions, slot_mapping,\n"
"                 context_lens) -> sample rows, or None when every row samples\n\n"
"The first `count` chunks (one token each) into int32 buffers: each row's token, position,\n"
"KV slot (its block's slot for the position) and context length (position + 1).");

static PyObject *fill_decode_rows(PyObject *self, PyObject *args) {
    PyObject *chunks, *bufs[4];
    Py_ssize_t count;
    long block_size;
    if (!PyArg_ParseTuple(args, "O!nlOOOO", &PyTuple_Type, &chunks, &count, &block_size,
                          &bufs[0], &bufs[1], &bufs[2], &bufs[3]))
        return NULL;
    if (count < 0 || count > PyTuple_Size(chunks) || block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "fill_decode_rows: bad row count or block size");
        return NULL;
    }
    static const char *names[4] = {"input_ids", "positions", "slot_mapping", "context_lens"};
    Py_buffer views[4];
    int held = 0;
    PyObject *sample_rows = NULL;
    for (; held < 4; held++)
        if (int32_buffer(bufs[held], &views[held], count, names[held]) < 0) goto done;
    int32_t *ids = views[0].buf, *pos = views[1].buf, *slots = views[2].buf, *ctx = views[3].buf;
    int all_sample = 1;
    for (Py_ssize_t r = 0; r < count; r++) {
        PyObject *chunk = PyTuple_GetItem(chunks, r);  /* borrowed, as the fields below */
        PyObject *token_ids = chunk ? PyTuple_GetItem(chunk, CHUNK_TOKEN_IDS) : NULL;
        PyObject *token = token_ids ? PyTuple_GetItem(token_ids, 0) : NULL;
        PyObject *block_ids = token ? PyTuple_GetItem(chunk, CHUNK_BLOCK_IDS) : NULL;
        if (block_ids == NULL) goto done;
        long token_id = PyLong_AsLong(token);
        long start = PyLong_AsLong(PyTuple_GetItem(chunk, CHUNK_START_POS));
        if (PyErr_Occurred()) goto done;
        PyObject *block = PyTuple_GetItem(block_ids, start / block_size);
        if (block == NULL) goto done;
        long block_id = PyLong_AsLong(block);
        if (block_id == -1 && PyErr_Occurred()) goto done;
        ids[r] = (int32_t)token_id;
        pos[r] = (int32_t)start;
        slots[r] = (int32_t)(block_id * block_size + start % block_size);
        ctx[r] = (int32_t)(start + 1);
        if (PyTuple_GetItem(chunk, CHUNK_SAMPLE) != Py_True) all_sample = 0;
    }
    if (all_sample) {
        sample_rows = Py_None;
        Py_INCREF(sample_rows);
        goto done;
    }
    sample_rows = PyList_New(0);
    for (Py_ssize_t r = 0; sample_rows != NULL && r < count; r++) {
        PyObject *chunk = PyTuple_GetItem(chunks, r);
        int sample = PyObject_IsTrue(PyTuple_GetItem(chunk, CHUNK_SAMPLE));
        PyObject *row = sample > 0 ? PyLong_FromSsize_t(r) : NULL;
        if (sample < 0 || (sample > 0 && (row == NULL || PyList_Append(sample_rows, row) < 0)))
            Py_CLEAR(sample_rows);
        Py_XDECREF(row);
    }
done:
    while (held > 0) PyBuffer_Release(&views[--held]);
    return sample_rows;
}

PyDoc_STRVAR(write_table_rows_doc,
"write_table_rows(table, width, last_rows, rows, field) -> widest row's length\n\n"
"BlockTableRows.write: row r of `table` (int32, C-contiguous, `width` columns) starts with\n"
"the block ids of rows[r] (rows[r][field] where field >= 0), written only where that tuple\n"
"is not the very object `last_rows[r]` (the last step's); the columns after it keep what\n"
"they held. `last_rows` becomes the new rows' tuples. ValueError, nothing written, where a\n"
"row is wider than the table.");

static PyObject *write_table_rows(PyObject *self, PyObject *args) {
    PyObject *table, *last_rows, *rows;
    Py_ssize_t width;
    int field;
    if (!PyArg_ParseTuple(args, "OnO!Oi", &table, &width, &PyList_Type, &last_rows, &rows,
                          &field))
        return NULL;
    Py_ssize_t n = PyObject_Length(rows);
    if (n < 0) return NULL;
    PyObject *tuples = PyList_New(n);
    if (tuples == NULL) return NULL;
    Py_ssize_t widest = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *item = PySequence_GetItem(rows, r);
        PyObject *ids = item;
        if (item != NULL && field >= 0) {
            ids = PySequence_GetItem(item, field);
            Py_DECREF(item);
        }
        if (ids == NULL) { Py_DECREF(tuples); return NULL; }
        if (!PyTuple_Check(ids)) {
            PyErr_SetString(PyExc_TypeError, "a block table is a tuple of ints");
            Py_DECREF(ids); Py_DECREF(tuples);
            return NULL;
        }
        if (PyTuple_Size(ids) > widest) widest = PyTuple_Size(ids);
        PyList_SetItem(tuples, r, ids);  /* steals */
    }
    if (widest > width) {
        PyErr_Format(PyExc_ValueError, "a block table of %zd blocks in a table %zd wide",
                     widest, width);
        Py_DECREF(tuples);
        return NULL;
    }
    Py_buffer view;
    if (int32_buffer(table, &view, n * width, "block table") < 0) {
        Py_DECREF(tuples);
        return NULL;
    }
    int32_t *data = view.buf;
    Py_ssize_t common = PyList_Size(last_rows);
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *ids = PyList_GetItem(tuples, r);
        if (r < common && PyList_GetItem(last_rows, r) == ids) continue;
        Py_ssize_t len = PyTuple_Size(ids);
        for (Py_ssize_t c = 0; c < len; c++) {
            long id = PyLong_AsLong(PyTuple_GetItem(ids, c));
            if (id == -1 && PyErr_Occurred()) {
                /* Rows written so far hold their new tables; forget the old record. */
                PyList_SetSlice(last_rows, 0, PyList_Size(last_rows), NULL);
                PyBuffer_Release(&view);
                Py_DECREF(tuples);
                return NULL;
            }
            data[r * width + c] = (int32_t)id;
        }
    }
    PyBuffer_Release(&view);
    int rc = PyList_SetSlice(last_rows, 0, PyList_Size(last_rows), tuples);
    Py_DECREF(tuples);
    if (rc < 0) return NULL;
    return PyLong_FromSsize_t(widest);
}

/* ---- the module --------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"schedule_decodes", schedule_decodes, METH_VARARGS, schedule_decodes_doc},
    {"advance_chunks", advance_chunks, METH_VARARGS, advance_chunks_doc},
    {"resolve_rows", resolve_rows, METH_VARARGS, resolve_rows_doc},
    {"placeholder_sources", placeholder_sources, METH_VARARGS, placeholder_sources_doc},
    {"fill_decode_rows", fill_decode_rows, METH_VARARGS, fill_decode_rows_doc},
    {"write_table_rows", write_table_rows, METH_VARARGS, write_table_rows_doc},
    {NULL, NULL, 0, NULL},
};

static int intern_names(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1
    INTERN(s_status, "status");
    INTERN(s_request_id, "request_id");
    INTERN(s_num_computed_tokens, "num_computed_tokens");
    INTERN(s_output_token_ids, "output_token_ids");
    INTERN(s_prompt_token_ids, "prompt_token_ids");
    INTERN(s_block_ids, "block_ids");
    INTERN(s_num_steps, "num_steps");
    INTERN(s_sampling_params, "sampling_params");
    INTERN(s_max_tokens, "max_tokens");
    INTERN(s_mode, "mode");
    INTERN(s_stop, "stop");
    INTERN(s_stop_token_ids, "stop_token_ids");
    INTERN(s_text, "text");
    INTERN(s_num_emitted_chars, "num_emitted_chars");
    INTERN(s_detokenizer, "detokenizer");
    INTERN(s_holding, "_holding");
    INTERN(s_finished, "_finished");
    INTERN(s_texts, "_texts");
    INTERN(s_add, "add");
    INTERN(s_budget, "budget");
    INTERN(s_chunks, "chunks");
    INTERN(s_request, "request");
    INTERN(s_num_cached_tokens, "num_cached_tokens");
    INTERN(s_empty, "");
#undef INTERN
    if ((s_zero = PyLong_FromLong(0)) == NULL)
        return -1;
    return 0;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_step_core",
    "The engine step's per-row loops, compiled (engine/native/step_core.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__step_core(void) {
    if (s_status == NULL && intern_names() < 0) return NULL;
    return PyModule_Create(&module);
}
