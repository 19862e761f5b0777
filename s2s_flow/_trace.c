/* The trace's two per-batch updates, the engine's hot path after the rings themselves.
 *
 * received(table, batch, put_times, now) and emitted(table, batch, now) do exactly what
 * Trace.received / Trace.emitted in s2s_flow/trace.py do (that file is the reference and
 * the stand-in where this is not built): split the batch into runs of one turn, and per
 * run update that turn's NodeTurn record (first/last time, count, ring waits) and record
 * the first time each milestone (Message.mark()) passes. In Python that is a loop over
 * every message at every hop; here a message costs a slot read and, for the types that
 * can stand for a milestone, a second one: each message keeps what its mark() said (in
 * Message._mark), so mark() runs once per message, not twice per hop.
 *
 * setup(NodeTurn, Message) is called once by trace.py: the record class, whose fields
 * are read and written in their slots, and the message base class (a message's ``turn``
 * is read in its slot too).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyTypeObject *NodeTurn;        /* the record class */
static PyTypeObject *MessageType;     /* messages are instances of it */
static PyObject *s_mark, *s_mark_time, *s_has_marks;

/* NodeTurn's fields, read and written in their slots directly. */
enum { F_FIRST_IN, F_LAST_IN, F_FIRST_OUT, F_LAST_OUT, F_N_IN, F_N_OUT, F_WAIT_S, F_WAIT_MAX_S, F_MARKS_IN,
       F_MARKS_OUT, N_FIELDS };
static const char *field_names[N_FIELDS] = {"first_in", "last_in", "first_out", "last_out", "n_in", "n_out",
                                            "wait_s", "wait_max_s", "marks_in", "marks_out"};
static Py_ssize_t field_offset[N_FIELDS];
static Py_ssize_t mark_offset;  /* Message._mark: where a message keeps what mark() said */

/* The offset of a slot (a member descriptor holding any object) of ``type``, or -1. */
static Py_ssize_t slot_offset(PyObject *type, const char *name) {
    PyObject *descr = PyObject_GetAttrString(type, name);
    if (descr == NULL)
        return -1;
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type) && ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX)
        offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "setup(): %.100s.%s must be a slot", ((PyTypeObject *)type)->tp_name, name);
    Py_DECREF(descr);
    return offset;
}

static PyObject *rec_get(PyObject *rec, int f) {  /* borrowed */
    PyObject *v = *(PyObject **)((char *)rec + field_offset[f]);
    if (v == NULL)
        PyErr_Format(PyExc_AttributeError, "NodeTurn.%s is not set", field_names[f]);
    return v;
}

static void rec_set(PyObject *rec, int f, PyObject *v) {  /* v: new reference, taken */
    PyObject **slot = (PyObject **)((char *)rec + field_offset[f]);
    PyObject *old = *slot;
    *slot = v;
    Py_XDECREF(old);
}

/* What the trace needs of a message type, for the few types a batch holds: where its
 * ``turn`` slot is (per type: Python 3.10 gives a dataclass subclass its own copies of the
 * base's slots) and whether it can stand for a milestone. Entries hold their type. */
typedef struct {
    PyObject *type;
    Py_ssize_t turn_offset;
    int has_marks;
} TypeInfo;

#define TYPE_CACHE 4
static TypeInfo type_cache[TYPE_CACHE];
static int type_next;

static void forget_types(void) {
    for (int k = 0; k < TYPE_CACHE; k++)
        Py_CLEAR(type_cache[k].type);
    type_next = 0;
}

/* Fills ``out`` (a copy: Python code run by a lookup may let another thread reuse a cache
 * entry meanwhile); 0, or -1 with an error set. */
static int info_of(PyObject *msg, TypeInfo *out) {
    PyObject *type = (PyObject *)Py_TYPE(msg);
    for (int k = 0; k < TYPE_CACHE; k++) {
        if (type_cache[k].type == type) {
            *out = type_cache[k];
            return 0;
        }
    }
    if (!PyObject_TypeCheck(msg, MessageType)) {
        PyErr_Format(PyExc_TypeError, "trace: expected a Message, got %.100s", Py_TYPE(msg)->tp_name);
        return -1;
    }
    Py_ssize_t offset = slot_offset(type, "turn");
    if (offset < 0)
        return -1;
    PyObject *v = PyObject_GetAttr(type, s_has_marks);
    int marks = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (marks < 0)
        return -1;
    out->type = type;
    out->turn_offset = offset;
    out->has_marks = marks;
    TypeInfo *entry = &type_cache[type_next];
    type_next = (type_next + 1) % TYPE_CACHE;
    PyObject *old = entry->type;
    *entry = *out;
    Py_INCREF(type);
    Py_XDECREF(old);  /* last: it may run Python code */
    return 0;
}

static PyObject *turn_of(PyObject *msg) {  /* borrowed */
    TypeInfo info;
    if (info_of(msg, &info) < 0)
        return NULL;
    PyObject *turn = *(PyObject **)((char *)msg + info.turn_offset);
    if (turn == NULL)
        PyErr_SetString(PyExc_AttributeError, "trace: a message without its turn");
    return turn;
}

static int has_marks(PyObject *msg) {
    TypeInfo info;
    return info_of(msg, &info) < 0 ? -1 : info.has_marks;
}

/* rec.<f> += add (an int field) */
static int add_int(PyObject *rec, int f, Py_ssize_t add) {
    PyObject *v = rec_get(rec, f);
    Py_ssize_t n = v == NULL ? -1 : PyLong_AsSsize_t(v);
    if (n == -1 && PyErr_Occurred())
        return -1;
    PyObject *sum = PyLong_FromSsize_t(n + add);
    if (sum == NULL)
        return -1;
    rec_set(rec, f, sum);
    return 0;
}

static int set_float(PyObject *rec, int f, double value) {
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL)
        return -1;
    rec_set(rec, f, v);
    return 0;
}

static double get_float(PyObject *rec, int f) {  /* -1.0 with an error set on failure */
    PyObject *v = rec_get(rec, f);
    return v == NULL ? -1.0 : PyFloat_AsDouble(v);
}

/* The record of ``turn`` in ``table`` (new reference), created with ``first`` = now when absent;
 * when present, ``first`` is set to now if it is still None. */
static PyObject *record(PyObject *table, PyObject *turn, int first, PyObject *now) {
    PyObject *rec = PyDict_GetItemWithError(table, turn);
    if (rec == NULL) {
        if (PyErr_Occurred())
            return NULL;
        PyObject *kwargs = Py_BuildValue("{sO}", field_names[first], now);
        if (kwargs == NULL)
            return NULL;
        PyObject *empty = PyTuple_New(0);
        rec = empty ? PyObject_Call((PyObject *)NodeTurn, empty, kwargs) : NULL;
        Py_XDECREF(empty);
        Py_DECREF(kwargs);
        if (rec == NULL || PyDict_SetItem(table, turn, rec) < 0) {
            Py_XDECREF(rec);
            return NULL;
        }
        return rec;
    }
    if (!PyObject_TypeCheck(rec, NodeTurn)) {
        PyErr_Format(PyExc_TypeError, "trace: a table holds a %.100s, not a NodeTurn", Py_TYPE(rec)->tp_name);
        return NULL;
    }
    PyObject *v = rec_get(rec, first);
    if (v == NULL)
        return NULL;
    if (v == Py_None)
        rec_set(rec, first, Py_NewRef(now));
    return Py_NewRef(rec);
}

/* For msgs[i:j]: the first time each new milestone is seen goes into rec.<marks>, as ``now``
 * (received) or as the message's mark_time() (emitted, now == NULL). */
static int note_marks(PyObject *rec, int marks_field, PyObject **msgs, Py_ssize_t i, Py_ssize_t j,
                      PyObject *now) {
    PyObject *marks = NULL;
    for (Py_ssize_t k = i; k < j; k++) {
        int marked = has_marks(msgs[k]);
        if (marked < 0)
            goto fail;
        if (!marked)
            continue;
        PyObject **memo = (PyObject **)((char *)msgs[k] + mark_offset), *name = *memo;
        if (name != NULL) {
            Py_INCREF(name);
        } else {  /* first time asked: mark() depends on the message's fields only */
            if ((name = PyObject_CallMethodNoArgs(msgs[k], s_mark)) == NULL)
                goto fail;
            if (*memo == NULL)  /* mark() may have let another thread answer it meanwhile */
                *memo = Py_NewRef(name);
        }
        if (name == Py_None) {
            Py_DECREF(name);
            continue;
        }
        if (marks == NULL && (marks = Py_XNewRef(rec_get(rec, marks_field))) == NULL) {
            Py_DECREF(name);
            goto fail;
        }
        if (!PyDict_Check(marks)) {
            Py_DECREF(name);
            PyErr_SetString(PyExc_TypeError, "trace: NodeTurn marks must be a dict");
            goto fail;
        }
        int seen = PyDict_Contains(marks, name);
        if (seen == 0) {
            PyObject *when = now;
            if (when == NULL)
                when = PyObject_CallMethodNoArgs(msgs[k], s_mark_time);
            else
                Py_INCREF(when);
            seen = when == NULL ? -1 : PyDict_SetItem(marks, name, when);
            Py_XDECREF(when);
        }
        Py_DECREF(name);
        if (seen < 0)
            goto fail;
    }
    Py_XDECREF(marks);
    return 0;
fail:
    Py_XDECREF(marks);
    return -1;
}

/* End of the run of one turn that starts at i. */
static Py_ssize_t run_end(PyObject **msgs, Py_ssize_t i, Py_ssize_t n, PyObject *turn) {
    Py_ssize_t j = i + 1;
    for (; j < n; j++) {
        PyObject *t = turn_of(msgs[j]);
        if (t == NULL)
            return -1;
        if (t != turn) {
            int same = PyObject_RichCompareBool(t, turn, Py_EQ);
            if (same < 0)
                return -1;
            if (!same)
                break;
        }
    }
    return j;
}

static int ready(void) {
    if (NodeTurn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "s2s_flow._trace: setup() was not called");
        return 0;
    }
    return 1;
}

/* The batch as a tuple (new reference), so its items stay valid whatever Python code
 * (mark(), NodeTurn()) does meanwhile; NULL with an error for an empty or wrong batch. */
static PyObject *messages_of(PyObject *batch, const char *who) {
    if (!PyList_Check(batch) && !PyTuple_Check(batch)) {
        PyErr_Format(PyExc_TypeError, "%s(): the batch must be a list or tuple of messages", who);
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(batch) == 0) {
        PyErr_Format(PyExc_IndexError, "%s(): an empty batch", who);
        return NULL;
    }
    return PyList_Check(batch) ? PyList_AsTuple(batch) : Py_NewRef(batch);
}

/* The run of one turn that starts at i: its turn in *turn (a held reference, replacing the
 * previous one) and its end, or -1 with an error set. */
static Py_ssize_t next_run(PyObject *batch, Py_ssize_t i, PyObject **turn) {
    Py_XSETREF(*turn, Py_XNewRef(turn_of(PyTuple_GET_ITEM(batch, i))));
    return *turn == NULL ? -1 : run_end(PySequence_Fast_ITEMS(batch), i, PyTuple_GET_SIZE(batch), *turn);
}

/* The ring waits of msgs[i:j], taken at now, added to rec (as Trace.received: the same sums). */
static int add_waits(PyObject *rec, PyObject *times, Py_ssize_t i, Py_ssize_t j, double now) {
    if (PyList_GET_SIZE(times) < j) {
        PyErr_SetString(PyExc_RuntimeError, "received(): put_times changed meanwhile");
        return -1;
    }
    double sum = 0.0;  /* the same order as Python's sum() */
    for (Py_ssize_t k = i; k < j; k++) {
        double t = PyFloat_AsDouble(PyList_GET_ITEM(times, k));
        if (t == -1.0 && PyErr_Occurred())
            return -1;
        sum += t;
    }
    double oldest = now - PyFloat_AsDouble(PyList_GET_ITEM(times, i));
    double wait = j - i == 1 ? oldest : (double)(j - i) * now - sum;
    double wait_s = get_float(rec, F_WAIT_S);
    if ((wait_s == -1.0 && PyErr_Occurred()) || set_float(rec, F_WAIT_S, wait_s + wait) < 0)
        return -1;
    double wait_max = get_float(rec, F_WAIT_MAX_S);
    if (wait_max == -1.0 && PyErr_Occurred())
        return -1;
    return oldest > wait_max ? set_float(rec, F_WAIT_MAX_S, oldest) : 0;
}

/* One batch into the table: in (put_times given: received) or out (put_times NULL: emitted). */
static PyObject *update(PyObject *table, PyObject *batch, PyObject *times, PyObject *now, const char *who) {
    if (!ready())
        return NULL;
    if (!PyDict_Check(table) || (times != NULL && !PyList_Check(times))) {
        PyErr_Format(PyExc_TypeError, "%s(): a dict, a batch of messages%s", who, times ? " and a list of put times" : "");
        return NULL;
    }
    double t_now = PyFloat_AsDouble(now);
    if (t_now == -1.0 && PyErr_Occurred())
        return NULL;
    if ((batch = messages_of(batch, who)) == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(batch);
    if (times != NULL && PyList_GET_SIZE(times) != n) {
        Py_DECREF(batch);
        PyErr_Format(PyExc_ValueError, "%s(): one put time per message", who);
        return NULL;
    }
    int in = times != NULL;
    PyObject **msgs = PySequence_Fast_ITEMS(batch);
    Py_XINCREF(times);
    PyObject *result = NULL, *turn = NULL;
    for (Py_ssize_t i = 0, j; i < n; i = j) {
        if ((j = next_run(batch, i, &turn)) < 0)
            goto done;
        PyObject *rec = record(table, turn, in ? F_FIRST_IN : F_FIRST_OUT, now);
        if (rec == NULL)
            goto done;
        rec_set(rec, in ? F_LAST_IN : F_LAST_OUT, Py_NewRef(now));
        int bad = add_int(rec, in ? F_N_IN : F_N_OUT, j - i) < 0;
        if (!bad && in)
            bad = add_waits(rec, times, i, j, t_now) < 0;
        /* a milestone's time: when it came in, or when it happened (mark_time()) on the way out */
        bad = bad || note_marks(rec, in ? F_MARKS_IN : F_MARKS_OUT, msgs, i, j, in ? now : NULL) < 0;
        Py_DECREF(rec);
        if (bad)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(turn);
    Py_XDECREF(times);
    Py_DECREF(batch);
    return result;
}

static PyObject *received(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "received(table, batch, put_times, now)");
        return NULL;
    }
    return update(args[0], args[1], args[2], args[3], "received");
}

static PyObject *emitted(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "emitted(table, batch, now)");
        return NULL;
    }
    return update(args[0], args[1], NULL, args[2], "emitted");
}

static PyObject *setup(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *record_class, *message_class;
    if (!PyArg_ParseTuple(args, "O!O!:setup", &PyType_Type, &record_class, &PyType_Type, &message_class))
        return NULL;
    Py_ssize_t offsets[N_FIELDS];
    for (int f = 0; f < N_FIELDS; f++)
        if ((offsets[f] = slot_offset(record_class, field_names[f])) < 0)
            return NULL;
    Py_ssize_t memo = slot_offset(message_class, "_mark");
    if (memo < 0)
        return NULL;
    memcpy(field_offset, offsets, sizeof(offsets));
    mark_offset = memo;
    Py_INCREF(record_class);
    Py_INCREF(message_class);
    Py_XSETREF(NodeTurn, (PyTypeObject *)record_class);
    Py_XSETREF(MessageType, (PyTypeObject *)message_class);
    forget_types();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"received", (PyCFunction)(void (*)(void))received, METH_FASTCALL,
     "received(table, batch, put_times, now): as Trace.received in s2s_flow/trace.py."},
    {"emitted", (PyCFunction)(void (*)(void))emitted, METH_FASTCALL,
     "emitted(table, batch, now): as Trace.emitted in s2s_flow/trace.py."},
    {"setup", setup, METH_VARARGS, "setup(NodeTurn, Message): the record class and the message base class."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "s2s_flow._trace", "The trace's per-batch updates (see s2s_flow/trace.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__trace(void) {
    if ((s_mark = PyUnicode_InternFromString("mark")) == NULL
        || (s_mark_time = PyUnicode_InternFromString("mark_time")) == NULL
        || (s_has_marks = PyUnicode_InternFromString("has_marks")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
